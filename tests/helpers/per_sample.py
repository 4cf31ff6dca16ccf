"""Per-sample gradients checked against autograd on each example alone."""

from __future__ import annotations

import torch


def assert_per_sample_grads_match(task, model, n: int = 3):
    """Opacus per-sample gradients (batched, padded) == autograd on each example alone; the layout
    probe (dpbench/privacy/layout.py) accepts the model's rows first."""
    from dpbench.privacy.layers import hooked_modules
    from dpbench.privacy.layout import LayoutProbe, check_layout
    from dpbench.privacy.per_sample import PerSampleGradients

    check_layout(model, hooked_modules(model, {}), LayoutProbe.of_task(task), "materialize")

    params = [p for p in model.parameters() if p.requires_grad]
    reference = []
    for i in range(n):
        loss = task.per_sample_loss(model, task.batch([i])).sum()
        reference.append(torch.autograd.grad(loss, params, allow_unused=True))
    engine = PerSampleGradients(model)
    try:
        per_sample = engine.backward_per_sample(task.per_sample_loss(model, task.batch(list(range(n)))))
    finally:
        engine.detach()
    for index, param in enumerate(params):
        for i in range(n):
            expected = reference[i][index]
            expected = torch.zeros_like(param) if expected is None else expected
            torch.testing.assert_close(per_sample[index][i], expected, rtol=1e-4, atol=1e-5)
    return params

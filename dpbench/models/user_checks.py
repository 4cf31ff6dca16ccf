"""The per-example checks a user's model (`model.builder`, dpbench/models/user.py) passes before a
private run trains it: dpbench's own models are covered by its tests, a user's module only by these.

1. Layers no engine forms per-example gradients for (`privacy.layout.check_layers`: torch's
   MultiheadAttention and recurrent layers, ...), then layers that mix the examples of a batch, as
   Opacus's `ModuleValidator` finds them (BatchNorm; InstanceNorm with running statistics), then any
   buffer a training forward writes (a running statistic of the batch: it would carry every
   example's data into the model unclipped and un-noised).
2. The layout probe (`privacy.layout.check_layout`): each example's rows stay together along
   dimension 0 in every layer the engine hooks (a sequence-first layer fails it).
3. The engine's per-example gradient norms on the first records equal autograd's on each example
   alone (float64 copy, dropout off): the norms the clip factors are computed from are the norms of
   what is summed.

Each failure is one line naming the layer and the fix (exit 2 from the console script).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models.user import names_builder

NORM_EXAMPLES = 4  # records whose norms are compared (the first of the training set)
NORM_TOLERANCE = 1e-4  # relative: the engines form norms in fp32 from a float64 model's pieces
LOW_PRECISION_TOLERANCE = 1e-2  # relative, for a model too large for a float64 copy (checked in its own dtype)


def check_user_model(cfg, task, model: nn.Module) -> None:
    """Run the checks of the module docstring on a user's model, or any model under a user's loss
    (`dataset.loss=package.module:function`), of a private run (others: nothing)."""
    from dpbench.algorithms import algorithm_class
    from dpbench.privacy.layers import hooked_modules
    from dpbench.privacy.layout import LayoutProbe, check_layers, check_layout

    algo = algorithm_class(cfg.algo.name)
    user_loss = ":" in str(cfg.dataset.get("loss") or "")  # a user's loss may mix examples too
    if not (names_builder(cfg.model) or user_loss) or not algo.private:
        return
    engine = str(cfg.algo.get("per_sample") or "materialize") if algo.per_example_engine else "materialize"
    name = f"model={cfg.model.name}"
    check_layers(model, engine)
    check_mixing_layers(model, name)
    probe = LayoutProbe.of_task(task)
    check_buffers_unwritten(model, probe, name)
    check_layout(model, hooked_modules(model, {}), probe, engine)
    if algo.per_example_engine:
        check_norms(model, probe, engine, name)


def check_mixing_layers(model: nn.Module, name: str) -> None:
    """Refuse a layer Opacus's ModuleValidator rejects (BatchNorm, InstanceNorm with running stats)."""
    from opacus.validators import ModuleValidator

    for layer, module in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is not None and any(p.requires_grad for p in module.parameters()) and validator(module):
            raise UserError(f"{name}: layer {layer or 'model'} ({type(module).__name__}) makes each example's output "
                            "depend on the other examples of its batch, so no per-example clip bounds its effect; "
                            "use nn.GroupNorm or nn.LayerNorm (opacus.validators.ModuleValidator.fix swaps them)")


def check_buffers_unwritten(model: nn.Module, probe, name: str) -> None:
    """Refuse a model whose training forward writes a buffer (a running statistic of the batch)."""
    subject = copy.deepcopy(model)
    before = {n: b.detach().clone() for n, b in subject.named_buffers()}
    if not before:
        return
    with torch.no_grad():
        probe.losses(subject, probe.batch(list(range(min(2, probe.size)))))
    for n, b in subject.named_buffers():
        if n in before and (b.shape != before[n].shape or not torch.equal(b, before[n])):
            raise UserError(f"{name}: buffer {n} changes during a training forward (a statistic of the batch), so it "
                            "carries every example's data into the model unclipped; compute it from public data or "
                            "drop it (BatchNorm: use nn.GroupNorm)")


def check_norms(model: nn.Module, probe, engine: str, name: str) -> None:
    """The engine's per-example gradient norms against autograd on each example alone."""
    from dpbench.privacy.engines import engine_spec
    from dpbench.privacy.layout import FLOAT64_COPY_LIMIT, _widen

    size = sum(t.numel() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()) * 8
    wide = size <= FLOAT64_COPY_LIMIT  # as the layout probe: a large model is copied in its own dtype
    subject = copy.deepcopy(model).double() if wide else copy.deepcopy(model)
    dtype, tolerance = (torch.float64, NORM_TOLERANCE) if wide else (None, LOW_PRECISION_TOLERANCE)
    for module in subject.modules():  # the same function in the batch and alone (train mode kept: the hooks need it)
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    indices = list(range(min(NORM_EXAMPLES, probe.size)))
    params = [p for p in subject.parameters() if p.requires_grad]
    expected = []
    for i in indices:
        loss = probe.losses(subject, _widen(probe.batch([i]), dtype)).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        expected.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    seen: list[torch.Tensor] = []

    def record(norms: torch.Tensor) -> torch.Tensor:
        seen.append(norms.detach().double().cpu())
        return torch.zeros_like(norms)  # nothing is summed: only the norms are compared

    hooked = engine_spec(engine).build(subject, {})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")  # as the trainer: inputs need no grad
            hooked.clipped_sum(probe.losses(subject, _widen(probe.batch(indices), dtype)), record)
    finally:
        hooked.detach()
    norms = seen[0] if seen else torch.zeros(len(indices), dtype=torch.float64)
    for i, (got, want) in enumerate(zip(norms.tolist(), torch.stack(expected).cpu().tolist())):
        if abs(got - want) > tolerance * max(abs(want), 1e-12) + 1e-9:
            # no value in the message: the norms are statistics of private records
            raise UserError(f"{name}: algo.per_sample={engine}'s per-example gradient norm of example {i} differs from "
                            "autograd's on that example alone, so clipping would not bound it; a layer mixes examples or a "
                            "parameter is read outside its own module's forward: keep each parameter inside its module")

"""The release -> update checks of `dpbench-audit` (dpbench/tools/audit/runner.py): the optimizer reads the
noisy release after public post-processing only, and no step changes a model buffer."""

from __future__ import annotations

import math

import torch

from dpbench.tools.audit.harness import stock_phase_algorithms, value_range
from dpbench.tools.audit.report import (
    UPDATE,
    Check,
)


def _relative(values: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """|values - reference| / |reference| over a list of tensors (inf when a value is missing)."""
    if any(v is None for v in values) or [v.shape for v in values] != [r.shape for r in reference]:
        return math.inf
    difference = math.sqrt(sum(float((v - r).pow(2).sum()) for v, r in zip(values, reference)))
    norm = math.sqrt(sum(float(r.pow(2).sum()) for r in reference))
    return difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)


def _plain_sgd(optimizer) -> float | None:
    """The learning rate of an SGD without momentum, weight decay or maximize (its parameter change is
    -lr x the gradient), else None."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    plain = not group.get("momentum") and not group.get("weight_decay") and not group.get("maximize")
    return float(group["lr"]) if plain else None


UPDATE_TOLERANCE = 1e-4  # relative: float32 rounding is ~1e-7; a broken update path is off by O(1)


def update_check(jobs) -> Check:
    """release -> update: at every audited step of the noise check's two jobs, the optimizer's input
    (the parameters' .grad at its step) is the step's recorded noisy release / the expected batch
    size (public post-processing only), and for a plain SGD the parameter change is -lr x that."""
    job, recorder = jobs[0]
    name = type(job.algorithm).__name__
    if not recorder.phases:
        return Check(UPDATE, "optimizer input", 0.0, UPDATE_TOLERANCE, True,
                     f"not applicable: {name} overrides DPFirstOrderAlgorithm's phases (its update is not release / "
                     "expected batch size); the check covers the algorithms that run them (`runs_stock_phases`: "
                     f"{', '.join(stock_phase_algorithms())})")
    expected_size = job.privacy.setup.expected_batch_size
    worst_grad, worst_change, steps, problems = 0.0, 0.0, 0, []
    sgd_lr = _plain_sgd(job.algorithm.optimizer)
    fp32 = all(p.dtype in (torch.float32, torch.float64) for p in job.algorithm.params)
    for _, rec in jobs:
        for step in sorted(rec.ledger):
            releases = rec.of_step(step)
            if len(releases) != 1 or len(releases[0].parts) != 1:
                problems.append(f"step {step} made {len(releases)} releases")
                continue
            steps += 1
            target = [v / expected_size for v in releases[0].noisy[0]]
            update = rec.updates.get(step)
            if update is None:
                worst_grad = math.inf
                problems.append(f"the optimizer did not step at step {step}")
                continue
            worst_grad = max(worst_grad, _relative(update.grads, target))
            if sgd_lr is not None and fp32:
                change = [a - b for a, b in zip(update.after, update.before)]
                worst_change = max(worst_change, _relative(change, [-sgd_lr * t for t in target]))
    worst = max(worst_grad, worst_change)
    change = (f"; the parameter change vs -lr x it: {worst_change:.3g}" if sgd_lr is not None and fp32
              else "; (the optimizer is not a plain SGD: its parameter change is not checked)")
    detail = (f"at each of the {steps} audited steps (2 fresh jobs, realised batch sizes differing from the expected "
              f"{expected_size:g}), the optimizer's gradient vs the recorded noisy release / {expected_size:g}: largest "
              f"relative deviation {worst_grad:.3g}{change}; anything but public post-processing of the release "
              f"(an un-noised sum, the realised batch size) deviates by O(1)")
    if problems:
        detail = "; ".join(problems[:2]) + "; " + detail
    return Check(UPDATE, "optimizer input", worst, UPDATE_TOLERANCE, worst <= UPDATE_TOLERANCE and not problems, detail)


def buffer_check(jobs) -> Check:
    """release → update on the model's buffers: at every audited step of the noise check's two jobs,
    no buffer changed. A step's only private output is its release; no dpbench algorithm writes a
    buffer from it, so a buffer the step wrote (BatchNorm's running mean and variance) carries the
    batch's un-noised statistics into the model."""
    names = [name for name, _ in jobs[0][0].model.named_buffers()]
    changed: dict[str, list] = {}  # buffer -> [largest relative change, the steps that changed it]
    steps = 0
    for _, recorder in jobs:
        for step, changes in sorted(recorder.buffers.items()):
            steps += 1
            for name, change in changes.items():
                entry = changed.setdefault(name, [0.0, set()])
                entry[0], entry[1] = max(entry[0], change), entry[1] | {step}
    worst = max((change for change, _ in changed.values()), default=0.0)
    if not names:
        detail = f"the model has no buffers: nothing a step could write besides its parameters ({steps} audited steps)"
    elif not changed:
        detail = f"none of the model's {len(names)} buffers changed at any of the {steps} audited steps (2 fresh jobs)"
    else:
        shown = sorted(changed.items(), key=lambda item: -item[1][0])
        listed = ", ".join(f"{name} (relative change {c:.3g}, steps {value_range(s)})" for name, (c, s) in shown[:3])
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        detail = (f"{len(changed)} of the model's {len(names)} buffers changed during private steps: {listed}{more}; "
                  "a buffer written from the batch (BatchNorm's running statistics) is un-noised batch data in "
                  "the model, which no release covers")
    return Check(UPDATE, "buffers", worst, 0.0, not changed, detail)

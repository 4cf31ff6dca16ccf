"""What one step of an Algorithm (base.py) produces and who may watch it: `StepResult` and the
`LossTally` that forms it, and the step hook (Opacus's `step_hook` style: an observer the owner
calls at named points) with the canary sites an algorithm declares (`Algorithm.canary_site`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from dpbench.privacy.mechanisms import GaussianMechanism

@dataclass
class StepResult:
    loss: float  # mean per-example training loss over the logical batch (nan when empty)
    batch_size: int  # realised logical batch size
    mechanisms: list[GaussianMechanism] = field(default_factory=list)  # the step's release: one mechanism (or none)


class LossTally:
    """Mean per-example training loss and realised size of one logical batch.

    The mean is over the examples whose loss is finite: a NaN or inf record contributes nothing to
    any release (clip factor 0) and must not halt the run through a non-finite mean either. Only a
    non-empty batch with no finite loss at all (a diverged model, not one record) gives nan."""

    def __init__(self) -> None:
        self.count = 0
        self.totals: torch.Tensor | float = 0.0  # [loss sum, finite count]; a tensor until result(): one host sync a step

    def add(self, losses: torch.Tensor) -> None:
        losses = losses.detach().double()
        finite = torch.isfinite(losses)
        kept = torch.where(finite, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
        self.totals = self.totals + torch.stack([kept.sum(), finite.sum().double()])
        self.count += losses.shape[0]

    def result(self) -> StepResult:
        total, finite = self.totals.tolist() if torch.is_tensor(self.totals) else (0.0, 0.0)
        return StepResult(total / finite if finite else float("nan"), self.count)


# ---- step hooks (Opacus's `step_hook` style): an observer the owner calls at named points ----
# dpbench-audit audit.one_run=true (dpbench/tools/audit/one_run.py) attaches one; every other run has
# none. The hook never writes into a clipped sum: its canaries are examples that join the step
# where the batch's examples do, before the per-example clipping, and are clipped as any example is.
EXAMPLES = "examples"  # canary examples, with their own per-example loss, join the step's per-example loop (`chunks`)
DIRECTION = "direction"  # canary examples, with their own two-point difference, join a zeroth-order estimate


@runtime_checkable
class OwnLossExamples(Protocol):
    """Examples a step hook adds to a step: a physical chunk that carries its own per-example loss
    (`Algorithm.per_example_losses` asks it instead of the task)."""

    def per_sample_loss(self, model: nn.Module) -> torch.Tensor: ...


@runtime_checkable
class OwnDifferenceExamples(Protocol):
    """Examples a step hook adds to a zeroth-order step: their per-example two-point differences
    s_i along the step's direction, before clipping (the estimate clips them as the batch's)."""

    def per_sample_differences(self) -> torch.Tensor: ...


class StepHook(Protocol):
    """Called by the Algorithm (base.py) running the step, which it receives as `algorithm`."""

    def begin_step(self, algorithm, step_index: int) -> None: ...

    def end_step(self, algorithm, step_index: int) -> None: ...

    def extra_examples(self, algorithm) -> list[OwnLossExamples | OwnDifferenceExamples]:
        """Physical chunks of examples that join this step after the batch's: `OwnLossExamples`
        at canary_site EXAMPLES, `OwnDifferenceExamples` at DIRECTION."""
        ...

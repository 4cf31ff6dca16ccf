"""The Algorithm seam, and the shared body of first-order DP algorithms.

An Algorithm owns its optimizer state and one `step(batches)`, where `batches` are the physical
chunks of one logical (Poisson) batch. It declares the privacy mechanisms each step runs so that
the accountant, not the algorithm, turns them into epsilon. It never opens files or logs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dpbench.privacy.mechanisms import GaussianMechanism, under_relation
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.per_sample import (
    GradSampler,
    PerSampleGradients,
    clip_factors,
    clipped_sum,
    per_sample_norms,
)
from dpbench.registry import Registry
from dpbench.tasks import Batch, Task


@dataclass
class PrivacySetup:
    noise_multiplier: float  # sigma: noise std = sigma * clip_norm on the clipped sum
    clip_norm: float  # C: per-example L2 bound, the sum's sensitivity (add/remove one)
    expected_batch_size: float  # public B = q * n; the clipped noisy sum is divided by it
    sample_rate: float  # q
    noise: GaussianNoise  # entropy-seeded generator (dpbench.privacy.noise)
    clipping: str = "flat"  # rule in dpbench.privacy.per_sample.CLIP_FACTORS
    clipping_gamma: float = 0.01
    neighboring: str = "add_remove"  # add_remove | replace_one: the relation epsilon is stated for


@dataclass
class StepResult:
    loss: float  # mean per-example training loss over the logical batch (nan when empty)
    batch_size: int  # realised logical batch size


class Algorithm(ABC):
    private: ClassVar[bool] = True

    def __init__(self, model: nn.Module, task: Task, cfg, lr: float, privacy: PrivacySetup | None):
        if self.private and privacy is None:
            raise ValueError(f"{type(self).__name__} is private and needs a PrivacySetup")
        self.model = model
        self.task = task
        self.cfg = cfg
        self.lr = lr
        self.privacy = privacy
        self.per_sample_grad_bytes = 0  # largest per-sample gradient working set held in a step

    # --- privacy declaration -------------------------------------------------------------
    @classmethod
    def planned_mechanisms(cls, cfg, noise_multiplier: float, sample_rate: float, step: int) -> list[GaussianMechanism]:
        """Mechanisms that step `step` runs for a base noise multiplier (used to calibrate sigma)."""
        return [GaussianMechanism(noise_multiplier, sample_rate)] if cls.private else []

    @classmethod
    def declared_mechanisms(
        cls, cfg, noise_multiplier: float, sample_rate: float, step: int, neighboring: str
    ) -> list[GaussianMechanism]:
        """`planned_mechanisms` stated under the run's neighbouring relation: what the ledger
        records, both for calibration (run.py) and for the steps that actually ran."""
        return under_relation(cls.planned_mechanisms(cfg, noise_multiplier, sample_rate, step), neighboring)

    def mechanisms_for_step(self, step: int) -> list[GaussianMechanism]:
        if not self.private:
            return []
        p = self.privacy
        return self.declared_mechanisms(self.cfg, p.noise_multiplier, p.sample_rate, step, p.neighboring)

    def extra_results(self) -> dict:
        """Algorithm-specific facts for results.json (e.g. secondary noise multipliers)."""
        return {}

    # --- training --------------------------------------------------------------------------
    @abstractmethod
    def step(self, batches: list[Batch]) -> StepResult: ...

    @abstractmethod
    def optimizer_state_bytes(self) -> int: ...


def torch_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (moments, momentum buffers), excluding step counters."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and key != "step"
    )


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class DPFirstOrderAlgorithm(Algorithm):
    """Per-example gradients -> clip -> sum over the logical batch -> Gaussian noise once -> / B.

    Subclasses choose the optimizer (`build_optimizer`) and may change what is privatised:
    `sampler_overrides` transforms per-sample gradients inside the backward hooks (DP-GRAPE
    projects there), `noise_shapes` gives the shapes of the privatised sums when a step sees no
    example, and `apply_update` consumes the privatised gradient.
    """

    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.engine = PerSampleGradients.for_mode(cfg.get("per_sample", "materialize"), model, self.sampler_overrides())
        self.optimizer = self.build_optimizer(self.params)

    def sampler_overrides(self) -> dict[nn.Module, GradSampler]:
        return {}

    def noise_shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @abstractmethod
    def build_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer: ...

    def clipped_gradient_sum(self, batches: list[Batch]) -> tuple[list[torch.Tensor], float, int]:
        """Sum over the logical batch of clipped per-example gradients (fp32), mean loss, size."""
        sums: list[torch.Tensor] | None = None
        loss_total, count = 0.0, 0
        for batch in batches:
            size = self.task.batch_size(batch)
            if size == 0:
                continue
            losses = self.task.per_sample_loss(self.model, batch)
            # algo.per_sample picks how (materialize | ghost | bk); the clipped sum is the same.
            contribution, working_bytes = self.engine.clipped_sum(
                losses,
                lambda norms: clip_factors(
                    norms, self.privacy.clip_norm, self.privacy.clipping, self.privacy.clipping_gamma
                ),
            )
            self.per_sample_grad_bytes = max(self.per_sample_grad_bytes, working_bytes)
            sums = contribution if sums is None else [s.add_(c) for s, c in zip(sums, contribution)]
            loss_total += losses.detach().float().sum().item()
            count += size
        if sums is None:  # an empty Poisson batch still releases (pure) noise
            device = self.params[0].device
            sums = [torch.zeros(shape, device=device, dtype=torch.float32) for shape in self.noise_shapes()]
        return sums, (loss_total / count if count else float("nan")), count

    def privatize(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """Add N(0, (sigma C)^2) to each summed coordinate and divide by the expected batch size."""
        std = self.privacy.noise_multiplier * self.privacy.clip_norm
        return [
            (s + self.privacy.noise.sample(s.shape, std)) / self.privacy.expected_batch_size for s in sums
        ]

    def apply_update(self, gradients: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, gradients):
            p.grad = g.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batches: list[Batch]) -> StepResult:
        sums, loss, count = self.clipped_gradient_sum(batches)
        self.apply_update(self.privatize(sums))
        return StepResult(loss, count)

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algo")

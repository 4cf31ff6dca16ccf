"""The Algorithm seam, and the shared body of first-order DP algorithms.

An Algorithm owns its optimizer state and one `step(batches)`, where `batches` are the physical
chunks of one logical (Poisson) batch. It declares the privacy mechanisms each step runs so that
the accountant, not the algorithm, turns them into epsilon. It never opens files or logs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import nn

from dpbench.privacy.mechanisms import GaussianMechanism, joint_noise_multiplier, under_relation
from dpbench.privacy.plan import PrivacySetup
from dpbench.privacy.per_sample import (
    GradSampler,
    PerSampleGradients,
    clip_factors,
)
from dpbench.registry import Registry
from dpbench.tasks import Batch, Task


@dataclass
class StepResult:
    loss: float  # mean per-example training loss over the logical batch (nan when empty)
    batch_size: int  # realised logical batch size
    mechanisms: list[GaussianMechanism] = field(default_factory=list)  # the noisy releases that ran


@dataclass
class ReleasePart:
    """One privatised quantity: a sum over the batch, the L2 sensitivity of that sum under
    add/remove-one (enforced by clipping), and the std of the Gaussian noise added per coordinate."""

    values: list[torch.Tensor]
    sensitivity: float
    noise_std: float


# Observer of every noisy release (dpbench-audit): (name, parts, noisy values, mechanism).
ReleaseObserver = Callable[[str, list[ReleasePart], list[list[torch.Tensor]], GaussianMechanism], None]


class Algorithm(ABC):
    private: ClassVar[bool] = True
    # keys of extra_results() computed from the private batch without noise (dropped when
    # privacy.log_private_stats=false)
    unnoised_results: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module, task: Task, cfg, lr: float, privacy: PrivacySetup | None):
        if self.private and privacy is None:
            raise ValueError(f"{type(self).__name__} is private and needs a PrivacySetup")
        self.model = model
        self.task = task
        self.cfg = cfg
        self.lr = lr
        self.privacy = privacy
        self.per_sample_grad_bytes = 0  # largest per-sample gradient working set held in a step
        self.step_mechanisms: list[GaussianMechanism] = []  # releases of the step in progress
        self.release_observer: ReleaseObserver | None = None

    # --- privacy: the plan ---------------------------------------------------------------------
    @classmethod
    def planned_mechanisms(
        cls, cfg, noise_multiplier: float, sample_rate: float, step: int, clip_norm: float
    ) -> list[GaussianMechanism]:
        """Mechanisms that step `step` will run for a base noise multiplier and clip norm: the one
        planning function, used to calibrate sigma and to check every step that ran."""
        return [GaussianMechanism(noise_multiplier, sample_rate)] if cls.private else []

    @classmethod
    def declared_mechanisms(
        cls, cfg, noise_multiplier: float, sample_rate: float, step: int, clip_norm: float, neighboring: str
    ) -> list[GaussianMechanism]:
        """`planned_mechanisms` stated under the run's neighbouring relation."""
        return under_relation(cls.planned_mechanisms(cfg, noise_multiplier, sample_rate, step, clip_norm), neighboring)

    @classmethod
    def privacy_notes(cls, cfg) -> list[str]:
        """Facts about this configuration that change what the reported epsilon means."""
        return []

    def planned_for_step(self, step: int) -> list[GaussianMechanism]:
        if not self.private:
            return []
        p = self.privacy
        return self.declared_mechanisms(self.cfg, p.noise_multiplier, p.sample_rate, step, p.clip_norm, p.neighboring)

    # --- privacy: what ran ---------------------------------------------------------------------
    def gaussian_release(self, name: str, *parts: ReleasePart) -> list[list[torch.Tensor]]:
        """Add N(0, std^2) to every coordinate of each part and record the mechanism that ran.

        Parts released together read the same sampled batch, so they are ONE subsampled Gaussian
        mechanism whose noise multiplier is that of the whitened pair (joint_noise_multiplier).
        The mechanism is derived from the noise actually drawn and the sensitivity the clipping
        enforces, so the ledger holds what ran, not what was meant to run.
        """
        noise = self.privacy.noise
        noisy = [[v + noise.sample(v.shape, part.noise_std) for v in part.values] for part in parts]
        mechanism = GaussianMechanism(
            joint_noise_multiplier([(part.noise_std, part.sensitivity) for part in parts]),
            self.privacy.sample_rate,
            self.privacy.neighboring,
        )
        self.step_mechanisms.append(mechanism)
        if self.release_observer is not None:
            self.release_observer(name, list(parts), noisy, mechanism)
        return noisy

    def extra_results(self) -> dict:
        """Algorithm-specific facts for results.json (e.g. secondary noise multipliers)."""
        return {}

    # --- training --------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], step_index: int) -> StepResult:
        """Run step `step_index` (the trainer's counter, the only one) and report what it released."""
        self.step_mechanisms = []
        result = self.step(batches, step_index)
        result.mechanisms = self.step_mechanisms
        self.step_mechanisms = []
        return result

    @abstractmethod
    def step(self, batches: list[Batch], step_index: int) -> StepResult: ...

    def backward_mean_loss(self, batches: list[Batch]) -> tuple[float, int]:
        """Non-private gradient accumulation over the physical chunks: backpropagate the mean
        loss of the logical batch into .grad. Returns (mean loss, realised size); nothing is
        backpropagated for an empty batch."""
        total = sum(self.task.batch_size(b) for b in batches)
        loss_total = 0.0
        for batch in batches if total else []:
            if self.task.batch_size(batch) == 0:
                continue
            losses = self.task.per_sample_loss(self.model, batch)
            (losses.sum() / total).backward()
            loss_total += losses.detach().float().sum().item()
        return (loss_total / total if total else float("nan")), total

    @abstractmethod
    def optimizer_state_bytes(self) -> int: ...

    # --- checkpoints (dpbench/checkpoint.py) -------------------------------------------------------
    # State that lives in attributes, as dotted names (tensors, generators, dicts keyed by
    # parameters, containers of them); each class adds its own, collected along the MRO.
    checkpoint_attributes: ClassVar[tuple[str, ...]] = ("per_sample_grad_bytes",)

    def checkpointed_attributes(self) -> list[str]:
        names = [a for cls in reversed(type(self).__mro__) for a in vars(cls).get("checkpoint_attributes", ())]
        return list(dict.fromkeys(names))

    def state_dict(self) -> dict:
        """What continuing this run needs: trainable parameters and buffers (frozen parameters are
        rebuilt from config and seed; their fingerprint is kept), a torch `optimizer`'s state and
        the `checkpoint_attributes`."""
        from dpbench.checkpoint import frozen_fingerprint, pack

        names = {id(p): n for n, p in self.model.named_parameters()}
        optimizer = getattr(self, "optimizer", None)
        if "_frozen_fingerprint" not in vars(self):  # frozen parameters never change: computed once
            self._frozen_fingerprint = frozen_fingerprint(self.model)
        return {
            "parameters": {n: pack(p, names) for n, p in self.model.named_parameters() if p.requires_grad},
            "buffers": {n: pack(b, names) for n, b in self.model.named_buffers()},
            "frozen": self._frozen_fingerprint,
            "optimizer": pack(optimizer.state_dict(), names) if isinstance(optimizer, torch.optim.Optimizer) else None,
            "attributes": {a: pack(_attribute(self, a), names) for a in self.checkpointed_attributes()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` into this freshly built algorithm (CheckpointMismatch if it does not fit)."""
        from dpbench.checkpoint import CheckpointMismatch, check_frozen, unpack

        parameters = dict(self.model.named_parameters())
        stored = {**state["parameters"], **state["buffers"]}
        current = {**{n: p for n, p in parameters.items() if p.requires_grad}, **dict(self.model.named_buffers())}
        if set(stored) != set(current) or any(stored[n].shape != current[n].shape for n in current):
            raise CheckpointMismatch("its trained parameters or buffers differ in name or shape")
        check_frozen(self.model, state["frozen"])
        with torch.no_grad():
            for name, tensor in current.items():
                tensor.copy_(stored[name])
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.load_state_dict(state["optimizer"])
        if set(state["attributes"]) != set(self.checkpointed_attributes()):
            raise CheckpointMismatch(f"it holds {sorted(state['attributes'])}, {type(self).__name__} needs "
                                     f"{sorted(self.checkpointed_attributes())}")
        device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
        for dotted, saved in state["attributes"].items():
            owner, _, name = dotted.rpartition(".")
            target = _attribute(self, owner) if owner else self
            setattr(target, name, unpack(saved, getattr(target, name), device, parameters))


def _attribute(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


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


class NonPrivateOptimizerAlgorithm(Algorithm):
    """A torch optimizer on the mean loss of the logical batch: no clipping, no noise, nothing in
    the ledger. Subclasses choose the optimizer (`build_optimizer`)."""

    private = False

    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer(self.params)

    @abstractmethod
    def build_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer: ...

    def step(self, batches: list[Batch], step_index: int) -> StepResult:
        loss, total = self.backward_mean_loss(batches)
        if total:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, total)

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)  # moments / momentum buffers


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
        """Add N(0, (sigma C)^2) to each summed coordinate (sensitivity C) and divide by the
        expected batch size."""
        p = self.privacy
        (noisy,) = self.gaussian_release("gradient", ReleasePart(sums, p.clip_norm, p.noise_multiplier * p.clip_norm))
        return [s / p.expected_batch_size for s in noisy]

    def apply_update(self, gradients: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, gradients):
            p.grad = g.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batches: list[Batch], step_index: int) -> StepResult:
        sums, loss, count = self.clipped_gradient_sum(batches)
        self.apply_update(self.privatize(sums))
        return StepResult(loss, count)

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algo")

"""The Algorithm seam (the shared body of first-order DP algorithms is in first_order.py).

An Algorithm owns its optimizer state and one `step(batches, step_index)`, where `batches` are the
physical chunks of one logical (Poisson) batch; the trainer calls it through `train_step`. It
declares the privacy mechanisms each step runs so that the accountant, not the algorithm, turns
them into epsilon. It never opens files, prints or logs: what a user should know goes to
`run_notes`, `extra_results()` or `privacy_notes(cfg)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from dpbench.algorithms.compute import BACKWARD, FORWARD, ComputeTally
from dpbench.algorithms.learning_rates import lr_groups
from dpbench.runtime import distributed, sharding
from dpbench.errors import DivergedError, UserError
from dpbench.precision import FP32, Precision, unscaled
from dpbench.privacy.mechanisms import GaussianMechanism, one_batch_mechanism, under_relation
from dpbench.privacy.clipping import PER_LAYER
from dpbench.privacy.plan import PrivacySetup
# The release lives in dpbench/privacy/release.py; its names stay importable from here.
from dpbench.privacy.release import (  # noqa: F401
    REPLICATED, SHARDED, SUMMED_SHARDS, Layout, ReleaseObserver, ReleasePart, gaussian_release,
)
from dpbench.registry import Registry
from dpbench.algorithms.steps import (  # noqa: F401 (the step's vocabulary, importable from here as before)
    DIRECTION, EXAMPLES, LossTally, OwnDifferenceExamples, OwnLossExamples, StepHook, StepResult,
)
from dpbench.tasks import Batch, Task

# Defaults the algorithms' options share (each algorithm's options dataclass lives in its own
# file, registered with its class: `@ALGORITHMS.register(name, options=...)`).
def adam_betas() -> list[float]:
    return [0.9, 0.999]


class Algorithm(ABC):
    private: ClassVar[bool] = True
    # keys of extra_results() computed from the private batch without noise (dropped when
    # privacy.log_private_stats=false)
    unnoised_results: ClassVar[tuple[str, ...]] = ()
    # libraries it imports when it runs, imported before memory is metered (dpbench/runtime/warmup.py)
    libraries: ClassVar[tuple[str, ...]] = ()
    precision: Precision = FP32  # the forward's autocast (train.precision); set with use_precision
    autocast_forward: ClassVar[bool] = True  # whether its forwards go through `chunks` (train.precision)
    data_parallel: ClassVar[bool] = True  # whether its releases are sums over examples (torchrun ranks add them)
    # whether train.sharding=fsdp runs it (dpbench/runtime/sharding.py asks `stated`: a subclass states it again)
    shardable: ClassVar[bool] = False
    # whether privacy.clipping=per_layer clips what it releases (each parameter's part to its own C_l,
    # first_order.py); asked with `stated`: an algorithm that clips its own quantities refuses it
    per_layer_clipping: ClassVar[bool] = False
    per_example_engine: ClassVar[bool] = False  # whether it forms per-example gradients with algo.per_sample's engine
    # Where dpbench-audit's one-run canaries enter a step (algorithms/steps.py); None: nowhere
    canary_site: ClassVar[str | None] = None
    step_hook: StepHook | None = None  # dpbench-audit audit.one_run=true only (algorithms/steps.py)
    # whether it keeps tensors across steps beyond the parameters and the optimizer's state, set from a
    # release and read by later steps: DC-DPSGD's threshold, DPDR's basis, DIFF's previous gradient,
    # DIFF2's estimate, naive DP-GaLore's projectors; dpbench-audit's two-step sensitivity row audits it
    # (a registry test checks the declaration against the state a class checkpoints)
    release_carries_state: ClassVar[bool] = False
    # The option naming the modules it trains in full beside what it adapts (LoRA's `train_modules`;
    # null there: the model family's `trained_modules`): the one-run audit adds its canary layer to
    # it. None: it trains every parameter the model leaves trainable.
    trained_modules_option: ClassVar[str | None] = None
    # Whether `dpbench algo=X logger=none` learns the default job (tests/algorithms/test_defaults.py
    # holds it to twice chance); False only with the reason beside it (DP-GD0th's d-dimensional noise)
    learns_default_job: ClassVar[bool] = True

    def __init__(self, model: nn.Module, task: Task, cfg, lr: float, privacy: PrivacySetup | None):
        if self.private and privacy is None:
            raise ValueError(f"{type(self).__name__} is private and needs a PrivacySetup")
        self.model = model
        self.task = task
        self.cfg = cfg
        self.lr = lr
        self.privacy = privacy
        if privacy is not None and privacy.clipping == PER_LAYER and not self.stated("per_layer_clipping"):
            takers = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).stated("per_layer_clipping")]
            raise UserError(f"algo={cfg.get('name', type(self).__name__)} does not take privacy.clipping=per_layer "
                            "(it clips its own per-example quantities, not each parameter's gradient); use "
                            f"privacy.clipping=flat, or algo={'|'.join(takers)}")
        self.step_mechanisms: list[GaussianMechanism] = []  # releases of the step in progress
        self.release_observer: ReleaseObserver | None = None
        self.sharded = sharding.is_sharded(model)  # train.sharding=fsdp (dpbench/runtime/sharding.py)
        # Facts about this run that change what its results mean; setup prints them and results.json
        # keeps them (algorithms never print).
        self.run_notes: list[str] = []
        self.compute = ComputeTally()  # forward-pass equivalents of the steps (algorithms/compute.py)

    # --- compute: the plan (algorithms/compute.py; what ran is counted in `per_example_losses`) ---
    @classmethod
    def forward_equivalents_per_example(cls, cfg, chunks: int) -> float:
        """Forward-pass equivalents a step spends per example of its batch (a forward 1, a backward 2),
        from the algorithm's options `cfg` and the physical chunks of a logical batch: what
        train.compute_budget plans with. Here: one forward and one backward."""
        return FORWARD + BACKWARD

    # --- privacy: the plan ---------------------------------------------------------------------
    @classmethod
    def planned_mechanisms(
        cls, cfg, noise_multiplier: float, sample_rate: float, step: int, clip_norm: float
    ) -> list[GaussianMechanism]:
        """The mechanism step `step` will run for a base noise multiplier and clip norm (a list of at
        most one: all of a step's releases read one sampled batch, see `one_batch_mechanism`): the
        one planning function, used to calibrate sigma and to check every step that ran."""
        return [GaussianMechanism(noise_multiplier, sample_rate)] if cls.private else []

    @classmethod
    def declared_mechanisms(
        cls, cfg, noise_multiplier: float, sample_rate: float, step: int, clip_norm: float, neighboring: str,
        derived=None,
    ) -> list[GaussianMechanism]:
        """`planned_mechanisms` stated under the run's neighbouring relation. `derived` (what the
        algorithm's own `calibrate_noise` derived) reaches only an algorithm that calibrates itself,
        as `planned_mechanisms(..., derived=...)`; the others' signature stays the plain one."""
        own = {} if derived is None else {"derived": derived}
        return under_relation(cls.planned_mechanisms(cfg, noise_multiplier, sample_rate, step, clip_norm, **own),
                              neighboring)

    # Optional classmethod `calibrate_noise(algo_cfg, calibration, epsilon, delta) -> (sigma, derived)`
    # for an algorithm that calibrates several noises itself (DC-DPSGD's epsilon split; see
    # privacy/plan.py `Calibration`): `derived` is a small dataclass of its own (a
    # `privacy.plan.CalibratedNoises`, e.g. DC-DPSGD's EpsilonSplit) or None, which the algorithm
    # reads from `PrivacySetup.derived`. None: the plan calibrates one sigma through planned_mechanisms.
    calibrate_noise: ClassVar[Callable | None] = None

    # Capabilities a subclass does not inherit unstated: a feature reads them with `stated`
    OWN_CAPABILITIES: ClassVar[tuple[str, ...]] = ("shardable", "per_layer_clipping")

    @classmethod
    def stated(cls, capability: str) -> bool:
        """`capability` (one of OWN_CAPABILITIES) as this class states it in its own body; a subclass
        that does not state it has the base's default (a DP-Adam variant is not shardable until it says so)."""
        if capability not in Algorithm.OWN_CAPABILITIES:
            raise ValueError(f"{capability!r} is not one of {Algorithm.OWN_CAPABILITIES}")
        return bool(vars(cls).get(capability, getattr(Algorithm, capability)))

    @classmethod
    def privacy_notes(cls, cfg) -> list[str]:
        """Facts about this configuration that change what the reported epsilon means."""
        return []

    @classmethod
    def runs_stock_phases(cls) -> bool:
        """Whether its update is DPFirstOrderAlgorithm's phases unchanged: release / expected batch size."""
        return False

    # --- privacy: what ran ---------------------------------------------------------------------
    def gaussian_release(self, name: str, *parts: ReleasePart, layout: Layout = REPLICATED) -> list[list[torch.Tensor]]:
        """The step's release of `parts` (dpbench.privacy.release.gaussian_release, which explains
        the mechanism and the layouts), under the run's noise, sample rate and relation. Its
        mechanism is charged to the step before the finiteness check, so a release that halts the
        run is charged too; the observer (dpbench-audit) sees every release."""
        noisy, _ = gaussian_release(
            name, parts, noise=self.privacy.noise, sample_rate=self.privacy.sample_rate,
            neighboring=self.privacy.neighboring, layout=layout, observer=self.release_observer,
            charge=self.step_mechanisms.append,
        )
        return noisy

    def extra_results(self) -> dict:
        """Algorithm-specific facts for results.json (e.g. secondary noise multipliers)."""
        return {}

    def unnoised_counters(self) -> dict:
        """Counts of the private batches' examples (results.json `algorithm`, un-noised, so written
        only with privacy.log_private_stats=true): examples dropped for a non-finite gradient."""
        dropped = getattr(self, "nonfinite_examples", None)
        return {"nonfinite_examples": int(dropped)} if dropped is not None else {}

    # --- training --------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], step_index: int) -> StepResult:
        """Run step `step_index` (the trainer's counter, the only one) and report what it released."""
        self.step_mechanisms = []
        self.task.set_step(step_index)
        if self.step_hook is not None:  # step hook: the step begins
            self.step_hook.begin_step(self, step_index)
        try:
            result = self.step(batches, step_index)
        except DivergedError as error:  # the releases that ran before the halt are charged (trainer)
            error.mechanisms = one_batch_mechanism(self.step_mechanisms)
            self.step_mechanisms = []
            raise
        result.mechanisms = one_batch_mechanism(self.step_mechanisms)  # every release read this one batch
        self.step_mechanisms = []
        self.compute.examples += result.batch_size  # this rank's, as its passes are
        if self.step_hook is not None:  # step hook: the step's update is applied
            self.step_hook.end_step(self, step_index)
        if distributed.is_distributed():  # report the logical batch's loss and size, not this rank's
            local_loss = result.loss * result.batch_size if result.batch_size else 0.0
            loss_total, size = distributed.all_reduce_scalars(local_loss, float(result.batch_size))
            result.loss, result.batch_size = (loss_total / size if size else float("nan")), int(size)
        return result

    @abstractmethod
    def step(self, batches: list[Batch], step_index: int) -> StepResult: ...

    def chunks(self, batches: list[Batch], tally: LossTally) -> Iterator[tuple[Batch, torch.Tensor]]:
        """The one per-example loop: each non-empty physical chunk of the logical batch with its
        per-example losses [b] (forward under the run's precision); `tally` counts the chunk's
        losses once the caller has used them.

        A sharded model (train.sharding=fsdp) runs as many chunks as the rank with the most: its
        forwards and backwards are collectives (FSDP2's all-gathers and reduce-scatters), which
        every rank must enter. A rank short of examples runs padding chunks instead of skipping:
        training example 0 alone, with `padding_chunk` set while the caller uses it, so that it
        gives it clip factor 0 (its contribution is exactly zero) and it is not tallied."""
        if self.sharded:
            yield from self._sharded_chunks(batches, tally)
            return
        for batch in batches:
            if self.task.batch_size(batch) == 0:
                continue
            losses = self.per_example_losses(batch)
            yield batch, losses
            tally.add(losses)
        if self.step_hook is not None:  # step hook: its examples join the loop (not tallied: the reported loss and size are the batch's)
            for extra in self.step_hook.extra_examples(self):
                yield extra, self.per_example_losses(extra)

    padding_chunk: bool = False  # the chunk `chunks` yields is padding (train.sharding=fsdp)

    def physical_batches(self, batches: list[Batch]) -> Iterator[tuple[Batch, bool]]:
        """(chunk, is padding) for each physical chunk a step runs: the non-empty ones, and for a
        sharded model as many as the rank with the most (padding: training example 0 alone, whose
        contribution the caller must leave out). `chunks` reads them; an algorithm that runs its
        own forwards (DPZero's two evaluations) follows the same rule through this."""
        kept = [batch for batch in batches if self.task.batch_size(batch) > 0]
        # FSDP2's forwards are collectives: every rank runs the busiest rank's count (agreed on
        # before the first forward, so that no rank's agreement meets another's all-gather)
        count = sharding.max_over_ranks(len(kept)) if self.sharded else len(kept)
        for position in range(count):
            yield (kept[position], False) if position < len(kept) else (self.task.batch([0]), True)

    def _sharded_chunks(self, batches: list[Batch], tally: LossTally) -> Iterator[tuple[Batch, torch.Tensor]]:
        for batch, padding in self.physical_batches(batches):
            self.padding_chunk = padding
            losses = self.per_example_losses(batch)
            try:
                yield batch, losses
            finally:
                padding, self.padding_chunk = self.padding_chunk, False
            if not padding:
                tally.add(losses)

    def use_precision(self, precision: Precision) -> None:
        """Run the forwards under `precision` (train.precision), or refuse it before training."""
        if precision.dtype is not None and not self.autocast_forward:
            raise UserError(f"train.precision={precision.name} applies to first-order algorithms; "
                            f"algo={self.cfg.name} runs in the model's dtype (model.dtype)")
        self.precision = precision

    def per_example_losses(self, batch: Batch) -> torch.Tensor:
        """Per-example losses [b] of a chunk: every forward of a step goes through here, where its
        passes are counted (`compute`: the forward now, each backward through them when it runs)."""
        if self.step_hook is not None and isinstance(batch, OwnLossExamples):  # a step hook's examples: their own loss
            return self.compute.forward(batch.per_sample_loss(self.model))
        with self.precision.autocast():
            return self.compute.forward(self.task.per_sample_loss(self.model, batch))

    def backward_mean_loss(self, batches: list[Batch]) -> LossTally:
        """Non-private gradient accumulation over the physical chunks: backpropagate the mean
        loss of the logical batch into .grad (nothing for an empty batch)."""
        total = sum(self.task.batch_size(b) for b in batches)
        tally, scale = LossTally(), self.precision.loss_scale
        for _, losses in self.chunks(batches, tally):
            (losses.float().sum() * (scale / total)).backward()
        if scale != 1.0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            for p, g in zip(params, unscaled([p.grad for p in params], scale)):
                p.grad = g.to(p.grad.dtype)
        return tally

    @abstractmethod
    def optimizer_state_bytes(self) -> int: ...

    @property
    def per_sample_grad_bytes(self) -> int:
        """Largest per-example working set held at once (0: none formed)."""
        return 0

    # --- checkpoints: dpbench/runtime/checkpoint.py saves and restores what these name ---------------------
    # State that lives in attributes, as dotted names (tensors, generators, dicts keyed by
    # parameters, containers of them); each class adds its own, collected along the MRO.
    checkpoint_attributes: ClassVar[tuple[str, ...]] = ()
    # Those of them that are un-noised statistics of the private batches, kept only for reporting
    # (realised sizes, tail fractions): a checkpoint of a run with privacy.log_private_stats=false
    # stores None for them, since resuming does not need them.
    private_statistic_attributes: ClassVar[tuple[str, ...]] = ()

    def checkpointed_attributes(self) -> list[str]:
        names = [a for cls in reversed(type(self).__mro__) for a in vars(cls).get("checkpoint_attributes", ())]
        return list(dict.fromkeys(names))

    def private_statistics(self) -> set[str]:
        return {a for cls in type(self).__mro__ for a in vars(cls).get("private_statistic_attributes", ())}


def torch_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (moments, momentum buffers), excluding step counters."""
    return sharding.local_bytes(  # this rank's shards of a sharded model's state (train.sharding=fsdp)
        value for state in optimizer.state.values() for key, value in state.items()
        if torch.is_tensor(value) and key != "step"
    )


def adam(params: list[nn.Parameter], lr: float, cfg) -> torch.optim.Adam:
    """torch's Adam, fused where torch has the fused kernel for these parameters: the default
    (for-each) Adam reads every parameter's step counter with `.item()`, one host sync per
    parameter and step on a GPU; the fused one makes none."""
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) and params
    return torch.optim.Adam(lr_groups(params, lr), lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                            fused=bool(fused) or None)


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
        tally = self.backward_mean_loss(batches)
        if tally.count:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return tally.result()

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)  # moments / momentum buffers


ALGORITHMS: Registry[type[Algorithm]] = Registry("algo", package="dpbench.algorithms")

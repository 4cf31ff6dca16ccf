"""The Algorithm seam, and the shared body of first-order DP algorithms.

An Algorithm owns its optimizer state and one `step(batches, step_index)`, where `batches` are the
physical chunks of one logical (Poisson) batch; the trainer calls it through `train_step`. It
declares the privacy mechanisms each step runs so that the accountant, not the algorithm, turns
them into epsilon. It never opens files, prints or logs: what a user should know goes to
`run_notes`, `extra_results()` or `privacy_notes(cfg)`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from dpbench.algorithms.learning_rates import lr_groups
from dpbench.runtime import distributed, sharding
from dpbench.errors import DivergedError, UserError
from dpbench.precision import FP32, Precision, unscaled
from dpbench.privacy.mechanisms import GaussianMechanism, one_batch_mechanism, under_relation
from dpbench.privacy.plan import PrivacySetup
from dpbench.privacy.clipping import clip_factors
from dpbench.privacy.engines import (
    COVERAGE_CHECK, LOSS_SCALE, PER_SAMPLE_ENGINES, Engine, EngineSpec, engine_spec, engines_with,
)
from dpbench.privacy.layout import LayoutProbe
from dpbench.privacy.per_sample import GradSampler
# The release lives in dpbench/privacy/release.py; its names stay importable from here.
from dpbench.privacy.release import (
    REPLICATED, SHARDED, SUMMED_SHARDS, Layout, ReleaseObserver, ReleasePart, gaussian_release,
)
from dpbench.registry import Registry
from dpbench.algorithms.steps import (  # noqa: F401 (the step's vocabulary, importable from here as before)
    DIRECTION, EXAMPLES, LossTally, OwnDifferenceExamples, OwnLossExamples, StepHook, StepResult,
)
from dpbench.options import choice_of
from dpbench.tasks import Batch, Task

# Choices and defaults the algorithms' options share (each algorithm's options dataclass lives in
# its own file, registered with its class: `@ALGORITHMS.register(name, options=...)`).
PerSample = choice_of("PerSample", PER_SAMPLE_ENGINES.names(), __name__)  # how per-example gradients are formed


def adam_betas() -> list[float]:
    return [0.9, 0.999]


class Algorithm(ABC):
    private: ClassVar[bool] = True
    # keys of extra_results() computed from the private batch without noise (dropped when
    # privacy.log_private_stats=false)
    unnoised_results: ClassVar[tuple[str, ...]] = ()
    precision: Precision = FP32  # the forward's autocast (train.precision); set with use_precision
    autocast_forward: ClassVar[bool] = True  # whether its forwards go through `chunks` (train.precision)
    data_parallel: ClassVar[bool] = True  # whether its releases are sums over examples (torchrun ranks add them)
    shardable: ClassVar[bool] = False  # whether train.sharding=fsdp runs it (dpbench/runtime/sharding.py asks)
    per_example_engine: ClassVar[bool] = False  # whether it forms per-example gradients with algo.per_sample's engine
    # Where dpbench-audit's one-run canaries enter a step (algorithms/steps.py); None: nowhere
    canary_site: ClassVar[str | None] = None
    step_hook: StepHook | None = None  # dpbench-audit audit.one_run=true only (algorithms/steps.py)
    # whether a step's release sets state (beyond the parameters) that the next step's release reads:
    # DC-DPSGD's threshold, DPDR's basis; dpbench-audit's two-step sensitivity row audits it
    release_carries_state: ClassVar[bool] = False

    def __init__(self, model: nn.Module, task: Task, cfg, lr: float, privacy: PrivacySetup | None):
        if self.private and privacy is None:
            raise ValueError(f"{type(self).__name__} is private and needs a PrivacySetup")
        self.model = model
        self.task = task
        self.cfg = cfg
        self.lr = lr
        self.privacy = privacy
        self.step_mechanisms: list[GaussianMechanism] = []  # releases of the step in progress
        self.release_observer: ReleaseObserver | None = None
        self.sharded = sharding.is_sharded(model)  # train.sharding=fsdp (dpbench/runtime/sharding.py)
        # Facts about this run that change what its results mean; setup prints them and results.json
        # keeps them (algorithms never print).
        self.run_notes: list[str] = []

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
        if self.step_hook is not None and isinstance(batch, OwnLossExamples):  # a step hook's examples: their own loss
            return batch.per_sample_loss(self.model)
        with self.precision.autocast():
            return self.task.per_sample_loss(self.model, batch)

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


def declared_option(cfg, key: str, default):
    """`cfg.key` where the algorithm's options dataclass declares `key`, else `default`: algorithm
    options accept undeclared keys (presets set one algorithm's option for a whole grid), and
    dpbench.schema.check_keys notes those as ignored."""
    name = cfg.get("name")
    options = ALGORITHMS.options(name) if name in ALGORITHMS.names() else None
    if options is not None and key not in {f.name for f in dataclasses.fields(options)}:
        return default
    return cfg.get(key, default)


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


class DPFirstOrderAlgorithm(Algorithm):
    """Per-example gradients -> clip -> sum over the logical batch -> Gaussian noise once -> / B.

    Subclasses choose the optimizer (`build_optimizer`) and may change what is privatised:
    `sampler_overrides` transforms per-sample gradients inside the backward hooks (DP-GRAPE
    projects there), `noise_shapes` gives the shapes of the privatised sums when a step sees no
    example, and `apply_update` consumes the privatised gradient.
    """

    # Capabilities (dpbench.privacy.engines) the algorithm uses beyond `clipped_sum`: DC-DPSGD
    # scores per-example gradients, DPDR decomposes them, DIFF/DIFF2 take their differences.
    engine_capabilities: ClassVar[frozenset[str]] = frozenset()
    canary_site = EXAMPLES  # canaries are examples: the engine forms and clips their gradients
    per_example_engine = True

    # Opacus's DPOptimizer phases (the seeded bugs and the audit's release -> update row ask which
    # classes run them unchanged: their update is release / expected batch size)
    STOCK_PHASES: ClassVar[tuple[str, ...]] = ("step", "privatize", "clip_and_accumulate", "add_noise", "scale_grad",
                                               "apply_update")

    @classmethod
    def runs_stock_phases(cls) -> bool:
        """Whether this class runs DPFirstOrderAlgorithm's own phases, overriding none of them."""
        return all(next(c for c in cls.__mro__ if name in vars(c)) is DPFirstOrderAlgorithm
                   for name in cls.STOCK_PHASES)

    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # algo.per_sample is an option where an algorithm can use every engine; where its options do
        # not declare it (a grid sets it for every algorithm), it is ignored, as the run's note says.
        # The capabilities are checked before the engine hooks the model.
        self.engine_spec: EngineSpec = engine_spec(declared_option(cfg, "per_sample", "materialize"))
        self.engine_spec.require(self.engine_capabilities, f"algo={cfg.get('name', type(self).__name__)}")
        # The layout probe (privacy/layout.py) runs here, once per model, before the engine hooks it.
        self.engine: Engine = self.engine_spec.attach(model, self.sampler_overrides(), LayoutProbe.of_task(task))
        self.optimizer = self.build_optimizer(self.params)
        self.nonfinite_examples: torch.Tensor | None = None  # examples given clip factor 0 (a tensor: no sync)

    checkpoint_attributes = ("engine.peak_bytes",)  # the engine meters the per-example working set
    private_statistic_attributes = ("engine.peak_bytes",)  # it depends on the largest realised batch

    def sampler_overrides(self) -> dict[nn.Module, GradSampler]:
        return {}

    def noise_shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @abstractmethod
    def build_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer: ...

    # Opacus's DPOptimizer phases; a variant overrides one at a time.
    def clip_and_accumulate(self, batches: list[Batch]) -> tuple[list[torch.Tensor], LossTally]:
        """Sum over the logical batch of clipped per-example gradients (fp32).

        Where `accumulates_shards` (a sharded model releasing SHARDED): this rank's shard rows of
        the sum over every rank's examples. Each physical chunk's sum of each parameter is
        sum-reduce-scattered over the ranks as the engine forms it (one parameter's full-size sum
        at a time: bk after its backward, ghost inside its second backward) and added into this
        rank's rows, so no full-size accumulator is held. Every rank runs as many chunks
        (`chunks`; padding ones contribute exact zeros), hence as many reduce-scatters, in the
        same order."""
        tally, sums = LossTally(), None
        shards = sharding.IntoShards(len(self.engine.params)) if self.accumulates_shards else None
        reduce = {} if shards is None else {"reduce": shards}
        for _, losses in self.chunks(batches, tally):
            # algo.per_sample picks how (materialize | ghost | bk); the clipped sum is the same.
            factors = sharding.zero_factors if self.padding_chunk else self.example_factors  # padding: exactly 0
            contribution = self.engine.clipped_sum(losses, factors, **reduce)
            if shards is not None:  # the engine handed every sum to `shards`, which added it up
                sums = shards.check(contribution)
            else:
                sums = contribution if sums is None else [s.add_(c) for s, c in zip(sums, contribution)]
            del contribution
        return (self.zero_sums() if sums is None else sums), tally  # an empty batch releases pure noise

    def example_factors(self, norms: torch.Tensor, clip: float | torch.Tensor | None = None,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example factors of the privacy's clipping rule at privacy.clip_norm, or flat clipping
        at `clip` (an algorithm's own bound: DPDR's C_perp, DIFF's C_d). An example whose norm is
        non-finite, or that `keep` leaves out, gets 0 and is counted, without a host sync."""
        p = self.privacy
        kept = torch.isfinite(norms) if keep is None else torch.isfinite(norms) & keep
        dropped = (~kept).sum()
        self.nonfinite_examples = dropped if self.nonfinite_examples is None else self.nonfinite_examples + dropped
        if clip is None:
            return clip_factors(norms, p.clip_norm, p.clipping, p.clipping_gamma, keep=kept)
        return clip_factors(norms, clip, keep=kept)

    def gradient_sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under add/remove-one: what clipping enforces."""
        return self.privacy.clip_norm

    def gradient_noise_std(self) -> float:
        return self.privacy.noise_multiplier * self.privacy.clip_norm

    # The release's layout on a sharded model (train.sharding=fsdp): SHARDED (each rank its shard
    # rows of each full-size sum, noised by this rank) or REPLICATED (sums small enough to hold
    # whole on every rank: DP-GRAPE's projected ones, one draw on rank 0, broadcast).
    sharded_layout: ClassVar[Layout] = SHARDED

    @property
    def accumulates_shards(self) -> bool:
        """Whether `clip_and_accumulate` keeps only this rank's shard rows of the summed clipped
        sums (a sharded model releasing SHARDED), which `add_noise` then releases as
        SUMMED_SHARDS: no second reduce-scatter."""
        return self.sharded and self.sharded_layout is SHARDED

    def add_noise(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's noisy release of the clipped sum (a sharded model: `sharded_layout`; by
        default the sums are already this rank's shard rows of the sum over the ranks,
        `clip_and_accumulate`, and this rank noises them, privacy/release.py's SUMMED_SHARDS)."""
        layout = self.sharded_layout if self.sharded else REPLICATED
        if self.accumulates_shards:
            shapes = [distributed.row_shard_shape(shape) for shape in self.noise_shapes()]
            if [s.shape for s in sums] != shapes:  # e.g. an override of clip_and_accumulate that sums full size
                raise RuntimeError("train.sharding=fsdp releases this rank's summed shard rows of each clipped sum "
                                   f"(clip_and_accumulate), shapes {[tuple(x) for x in shapes]}, not "
                                   f"{[tuple(s.shape) for s in sums]}")
            layout = SUMMED_SHARDS
        (noisy,) = self.gaussian_release("gradient", ReleasePart(sums, self.gradient_sensitivity(), self.gradient_noise_std()),
                                         layout=layout)
        return noisy

    def scale_grad(self, noisy_sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """Divide by the expected (not the realised) batch size: the realised one is private."""
        return [s / self.privacy.expected_batch_size for s in noisy_sums]

    def privatize(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.scale_grad(self.add_noise(sums))

    def apply_update(self, gradients: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, gradients):
            p.grad = sharding.sharded_grad(p, g) if self.sharded else g.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batches: list[Batch], step_index: int) -> StepResult:
        sums, tally = self.clip_and_accumulate(batches)
        self.apply_update(self.privatize(sums))
        return tally.result()

    def zero_sums(self) -> list[torch.Tensor]:
        """fp32 accumulators in the shapes of the privatised sums (`accumulates_shards`: of this
        rank's shard rows of them)."""
        device = self.params[0].device
        shapes = [distributed.row_shard_shape(s) for s in self.noise_shapes()] if self.accumulates_shards \
            else self.noise_shapes()
        return [torch.zeros(shape, device=device, dtype=torch.float32) for shape in shapes]

    @property
    def per_sample_grad_bytes(self) -> int:
        return self.engine.peak_bytes

    def use_precision(self, precision: Precision) -> None:
        if precision.loss_scale != 1.0 and not self.engine_spec.has(LOSS_SCALE):
            scaling = engines_with(LOSS_SCALE)
            others = [name for name in PER_SAMPLE_ENGINES.names() if name not in scaling]
            raise UserError(f"train.precision={precision.name} needs algo.per_sample={' or '.join(scaling)} (its loss "
                            "scale is divided out of the per-example gradients); use train.precision=bf16 for "
                            f"{' or '.join(others)}")
        super().use_precision(precision)
        if self.engine_spec.has(LOSS_SCALE):
            self.engine.loss_scale = precision.loss_scale
        if precision.dtype is not None and self.engine_spec.has(COVERAGE_CHECK):
            self.engine.tolerance = 2e-2  # the coverage check compares with autograd's own low-precision sums

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algo", package="dpbench.algorithms")

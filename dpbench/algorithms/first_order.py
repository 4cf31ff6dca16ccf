"""The shared body of first-order DP algorithms (DP-SGD and its variants): per-example gradients
from algo.per_sample's engine -> clip -> sum over the logical batch -> Gaussian noise once -> / B,
as Opacus's DPOptimizer phases, each overridable on its own."""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from dpbench.algorithms.compute import BACKWARD, FORWARD
from dpbench.algorithms.base import ALGORITHMS, EXAMPLES, Algorithm, LossTally, StepResult, torch_optimizer_state_bytes
from dpbench.errors import UserError
from dpbench.options import choice_of
from dpbench.precision import Precision
from dpbench.privacy.clipping import PER_LAYER, clip_factors, layer_thresholds, per_layer_factors
from dpbench.privacy.engines import (
    COVERAGE_CHECK, LOSS_SCALE, PER_LAYER_NORMS, PER_SAMPLE_ENGINES, Engine, EngineSpec, engine_spec, engines_with,
)
from dpbench.privacy.layout import LayoutProbe
from dpbench.privacy.per_sample import GradSampler
from dpbench.privacy.release import REPLICATED, SHARDED, SUMMED_SHARDS, Layout, ReleasePart
from dpbench.runtime import distributed, sharding
from dpbench.tasks import Batch

PerSample = choice_of("PerSample", PER_SAMPLE_ENGINES.names(), __name__)  # how per-example gradients are formed


def declared_option(cfg, key: str, default):
    """`cfg.key` where the algorithm's options dataclass declares `key`, else `default`: algorithm
    options accept undeclared keys (presets set one algorithm's option for a whole grid), and
    dpbench.schema.check_keys notes those as ignored."""
    name = cfg.get("name")
    options = ALGORITHMS.options(name) if name in ALGORITHMS.names() else None
    if options is not None and key not in {f.name for f in dataclasses.fields(options)}:
        return default
    return cfg.get(key, default)


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
    def forward_equivalents_per_example(cls, cfg, chunks: int) -> float:
        """One forward and the engine's backwards (algo.per_sample: ghost runs two) per example."""
        return FORWARD + BACKWARD * engine_spec(declared_option(cfg, "per_sample", "materialize")).backwards

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
        self.per_layer = privacy.clipping == PER_LAYER  # each parameter's per-example part clipped to its own C_l
        if self.per_layer:
            self.engine_spec.require({PER_LAYER_NORMS}, "privacy.clipping=per_layer")
        # The layout probe (privacy/layout.py) runs here, once per model, before the engine hooks it.
        self.engine: Engine = self.engine_spec.attach(model, self.sampler_overrides(), LayoutProbe.of_task(task))
        # privacy.clipping=per_layer: C_l per parameter of the engine's sums, fixed now from public
        # quantities only (the initial weights; before any checkpoint is loaded), Σ_l C_l² = C²
        self.layer_thresholds = layer_thresholds(self.engine.params, privacy.clip_norm, privacy.per_layer_thresholds) \
            if self.per_layer else None
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
            contribution = self.engine.clipped_sum(losses, factors, **reduce, **({"per_layer": True} if self.per_layer else {}))
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
        non-finite, or that `keep` leaves out, gets 0 and is counted, without a host sync.

        privacy.clipping=per_layer: `norms` [L, B] (the engine's per_layer=True) get factors [L, B],
        min(1, C_l / ‖g_{i,l}‖): each example's part in parameter l has norm ≤ C_l, Σ_l C_l² = C², so
        its whole contribution has norm ≤ C: the sum's sensitivity is C, the release's noise σC as
        for flat clipping. Per-example norms [B] under per_layer (an engine asked without it) are
        clipped flat at C, which bounds them alike."""
        p = self.privacy
        finite = torch.isfinite(norms).all(dim=0) if norms.dim() == 2 else torch.isfinite(norms)
        kept = finite if keep is None else finite & keep
        dropped = (~kept).sum()
        self.nonfinite_examples = dropped if self.nonfinite_examples is None else self.nonfinite_examples + dropped
        if clip is None and norms.dim() == 2:
            return per_layer_factors(norms, self.layer_thresholds, keep=kept)
        if clip is None and self.per_layer:
            return clip_factors(norms, p.clip_norm, keep=kept)
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


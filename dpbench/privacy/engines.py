"""The per-example engines (`algo.per_sample`): each computes the clipped sum Σ_i f_i g_i of a
physical batch with `clipped_sum(losses, factors_fn) -> sums` and meters its largest per-example
working set in `peak_bytes` (results.json's per_sample_grad_bytes).

`materialize` forms every per-sample gradient (Opacus's grad samplers, per_sample.py); `ghost`
takes norms without them, then a second backward that sums the clipped pieces in fp32; `bk`
(book-keeping) does it in one backward (both bookkeeping.py).

`Engine` is what every engine offers; anything more is a capability, declared here in the
registry (`EngineSpec.capabilities`) rather than probed on the object: callers ask the spec, and
an algorithm declares the capabilities it uses (`DPFirstOrderAlgorithm.engine_capabilities`), so
asking an engine for one it lacks is a one-line error before training. The capabilities:

    capability              materialize  ghost  bk   protocol: what the engine then offers
    per_example_gradients   yes          -      -    PerExampleGradients: backward_per_sample, meter
    loss_scale              yes          -      -    LossScaled: loss_scale divided out (fp16)
    coverage_check          -            yes    yes  CoverageChecked: tolerance of the coverage check
    sharded_sums            -            yes    yes  clipped_sum(..., reduce=): each sum reduced as formed (fsdp)
    per_layer_norms         yes          yes    yes  clipped_sum(..., per_layer=True): [L, B] norms and factors

`build_engine(mode, model, probe=LayoutProbe(...))` is the public way to build one on a model of
your own: it runs the layout probe (privacy/layout.py) first and refuses without a probe unless
told `unprobed=True`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.privacy.bookkeeping import BookKeeping
from dpbench.privacy.layers import hooked_modules
from dpbench.privacy.layout import LayoutProbe, check_layers, check_layout
from dpbench.privacy.per_sample import GradSampler, PerSampleGradients
from dpbench.registry import Registry

FactorsFn = Callable[[torch.Tensor], torch.Tensor]  # per-example norms [B] -> clip factors [B]


@runtime_checkable
class Engine(Protocol):
    """What `DPFirstOrderAlgorithm` uses of every engine."""

    params: list[nn.Parameter]  # the trainable parameters, in the order of the sums
    peak_bytes: int  # largest per-example working set held at once (checkpointed)
    # An observer `clipped_sum` calls with the list it returns (and whether `reduce` formed it), before
    # the caller adds it up: dpbench-audit's view of each chunk's clipped sums. It reads, never writes;
    # None in a run.
    sum_observer: Callable[[list[torch.Tensor], bool], None] | None

    def clipped_sum(self, losses: torch.Tensor, factors_fn: FactorsFn,
                    reduce: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Σ_i f_i g_i over the chunk (fp32, aligned with `params`), f = factors_fn(norms), norms [B]
        bounding each example's whole gradient (capability `per_layer_norms`: with `per_layer=True`,
        norms [L, B] bound each parameter's part, and factors [L, B] scale each parameter's part).
        `reduce(sum, position in params)` (train.sharding=fsdp: `distributed.reduce_scatter_rows`,
        a collective): applied to every parameter's sum once (zeros for one no hook reached), as
        soon as the engine allows, in an order that is the same on every rank; the list returned
        holds what it returned and no full-size sum outlives its reduction (bk: one parameter's
        full-size sum at a time, formed after the backward, in the order of `params`; ghost: one at
        a time too, each reduced inside the second backward as its hook forms it, in the
        backward's order; materialize: the chunk's sums are all formed first)."""
        ...

    def detach(self) -> None:
        """Remove the engine's hooks from the model."""
        ...


@runtime_checkable
class PerExampleGradients(Engine, Protocol):
    """Capability `per_example_gradients`: every per-example gradient, as tensors."""

    def backward_per_sample(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """Per-example gradients [B, ...] aligned with `params` (nothing left in .grad)."""
        ...

    def meter(self, held_bytes: int) -> None:
        """Record per-example bytes a caller holds at once (e.g. two sets of gradients)."""
        ...


@runtime_checkable
class LossScaled(Engine, Protocol):
    """Capability `loss_scale`: divides train.precision=fp16's loss scale out of what it sums."""

    loss_scale: float


@runtime_checkable
class CoverageChecked(Engine, Protocol):
    """Capability `coverage_check`: checks that its pieces cover autograd's gradient, to `tolerance`."""

    tolerance: float


PER_EXAMPLE_GRADIENTS = "per_example_gradients"
LOSS_SCALE = "loss_scale"
COVERAGE_CHECK = "coverage_check"
SHARDED_SUMS = "sharded_sums"
PER_LAYER_NORMS = "per_layer_norms"
CAPABILITIES = {  # capability -> what it means, as an error message says it
    PER_EXAMPLE_GRADIENTS: "every per-example gradient",
    LOSS_SCALE: "the loss scale divided out of the per-example gradients",
    COVERAGE_CHECK: "a coverage check",
    SHARDED_SUMS: "each parameter's clipped sum handed to a reduce as it is formed (train.sharding=fsdp)",
    PER_LAYER_NORMS: "each parameter's own per-example norm (privacy.clipping=per_layer)",
}


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: its name, how to build it, and the capabilities it has."""

    name: str
    build: Callable[[nn.Module, dict[nn.Module, GradSampler]], Engine]  # (model, sampler overrides)
    capabilities: frozenset[str] = frozenset()
    backwards: int = 1  # backward passes per chunk (ghost: a second, reweighted one): what compute is planned with

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"engine {self.name!r} declares unknown capabilities {sorted(unknown)}")

    def attach(self, model: nn.Module, sampler_overrides: dict[nn.Module, GradSampler] | None = None,
               probe: LayoutProbe | None = None) -> Engine:
        """The engine on `model`, after the checks every engine gets (privacy/layout.py): layer kinds
        no engine forms right are refused, and with a `probe` (the task's loss and records) every
        layer the engine hooks is shown to keep each example's rows together along dimension 0,
        before any hook is attached. The one way engines are built for training."""
        overrides = dict(sampler_overrides or {})
        check_layers(model, self.name)
        if probe is not None:
            check_layout(model, hooked_modules(model, overrides), probe, self.name)
        return self.build(model, overrides)

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def require(self, capabilities: Iterable[str], who: str) -> None:
        """A one-line UserError, naming the engines that would do, unless this one has `capabilities`."""
        missing = sorted(set(capabilities) - self.capabilities)
        if not missing:
            return
        needed = " and ".join(CAPABILITIES[c] for c in missing)
        fit = engines_with(*capabilities)
        raise UserError(f"{who} needs {needed}, which algo.per_sample={self.name} does not form; "
                        f"use algo.per_sample={' or '.join(fit)}")


PER_SAMPLE_ENGINES: Registry[EngineSpec] = Registry("algo.per_sample")


def register_engine(spec: EngineSpec) -> EngineSpec:
    return PER_SAMPLE_ENGINES.register(spec.name)(spec)


register_engine(EngineSpec("materialize", PerSampleGradients,
                           frozenset({PER_EXAMPLE_GRADIENTS, LOSS_SCALE, PER_LAYER_NORMS})))
register_engine(EngineSpec("ghost", lambda model, overrides: BookKeeping(model, overrides, passes=2),
                           frozenset({COVERAGE_CHECK, SHARDED_SUMS, PER_LAYER_NORMS}), backwards=2))
register_engine(EngineSpec("bk", lambda model, overrides: BookKeeping(model, overrides, passes=1),
                           frozenset({COVERAGE_CHECK, SHARDED_SUMS, PER_LAYER_NORMS})))


def engine_spec(mode: str) -> EngineSpec:
    """The registered engine `algo.per_sample=mode` (an unknown mode is a one-line error)."""
    return PER_SAMPLE_ENGINES.get(mode)


def engines_with(*capabilities: str) -> list[str]:
    """Names of the engines that have every one of `capabilities`, sorted."""
    return [n for n in PER_SAMPLE_ENGINES.names() if set(capabilities) <= PER_SAMPLE_ENGINES.get(n).capabilities]


def build_engine(mode: str, model: nn.Module, sampler_overrides: dict[nn.Module, GradSampler] | None = None, *,
                 needs: Iterable[str] = (), who: str = "this", probe: LayoutProbe | None = None,
                 unprobed: bool = False) -> Engine:
    """The engine for `algo.per_sample=mode` on `model`, after its layer checks and the layout probe
    on `probe` (`EngineSpec.attach`); a one-line error when it lacks a capability in `needs` (asked
    for by `who`).

        probe = LayoutProbe(losses, batch, size, largest=physical_batch)  # losses(model, batch) -> [B];
        engine = build_engine("bk", model, probe=probe)                  # batch(indices) -> a batch

    Without a probe nothing shows that the model keeps each example's rows together along dimension
    0 (a sequence-first or batch-mixing model would be clipped wrong), so it refuses in one line;
    `unprobed=True` builds the engine all the same, with a warning that the check was skipped."""
    spec = engine_spec(mode)
    spec.require(needs, who)
    if probe is None and not unprobed:
        raise UserError(f"build_engine({mode!r}, ...): no probe=LayoutProbe(losses, batch, size, largest=...), so "
                        "nothing shows that each example's rows stay together along dimension 0 (a sequence-first "
                        "or batch-mixing model would be clipped wrong); pass one, or unprobed=True to skip the check")
    if probe is None:
        warnings.warn(f"build_engine({mode!r}, ..., unprobed=True): the layout probe is skipped, so a sequence-first "
                      "or batch-mixing model is not refused and its clipped sum may exceed the clip bound",
                      UserWarning, stacklevel=2)
    return spec.attach(model, sampler_overrides, probe)

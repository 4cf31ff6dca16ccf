"""The per-example engines (`algo.per_sample`): each computes the clipped sum Σ_i f_i g_i of a
physical batch with `clipped_sum(losses, factors_fn) -> sums` and meters its largest per-example
working set in `peak_bytes` (results.json's per_sample_grad_bytes).

`materialize` forms every per-sample gradient (Opacus's grad samplers, per_sample.py); `ghost`
takes norms without them, then a second backward that sums the clipped pieces in fp32; `bk`
(book-keeping) does it in one backward (both bookkeeping.py).
"""

from __future__ import annotations

from torch import nn

from dpbench.privacy.bookkeeping import BookKeeping
from dpbench.privacy.per_sample import GradSampler, PerSampleGradients
from dpbench.registry import Registry

PER_SAMPLE_ENGINES: Registry = Registry("algo.per_sample")
PER_SAMPLE_ENGINES.register("materialize")(PerSampleGradients)
PER_SAMPLE_ENGINES.register("ghost")(lambda model, overrides: BookKeeping(model, overrides, passes=2))
PER_SAMPLE_ENGINES.register("bk")(lambda model, overrides: BookKeeping(model, overrides, passes=1))


def build_engine(mode: str, model: nn.Module, sampler_overrides: dict[nn.Module, GradSampler] | None = None):
    """The engine for `algo.per_sample=mode` (an unknown mode is a one-line error)."""
    return PER_SAMPLE_ENGINES.get(mode)(model, dict(sampler_overrides or {}))

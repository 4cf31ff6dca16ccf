"""Clipping: per-example norms, the clip rules' factors, and clipped sums accumulated in fp32.

Shared by every per-example engine (per_sample.py, bookkeeping.py) and by the algorithms that
clip their own per-example quantities (DC-DPSGD, DPDR, DIFF).

Per-layer clipping (`privacy.clipping=per_layer`): a layer is one trainable parameter tensor (the
engine's `params`; DP-GRAPE's projected weight gradient counts as its weight's). Each example's
gradient of layer l is clipped to C_l, the C_l fixed before training from public quantities only
with Σ_l C_l² = C², so the concatenated contribution has norm ≤ C and the sum's sensitivity is C.

A non-finite example (a NaN or inf the data holds, or a gradient that overflowed) gets clip factor
0 and contributes nothing to any sum. It is dropped with a select (`torch.where`), never by
multiplying by its factor: 0 · NaN and 0 · inf are NaN.
"""

from __future__ import annotations

from typing import Callable

import torch

from dpbench.privacy.rounding import UNIT_ROUNDOFF, _sum_of_squares, fp64_slack, round_down_fp32, round_up_fp32


def sum_rows_per_example(grad_sample: torch.Tensor, examples: int) -> torch.Tensor:
    """[R, ...] per-row gradients -> [B, ...] per-example ones, when an example spans R/B rows.

    Candidate scoring feeds K sequences per example, laid out example-major (rows b*K..b*K+K-1
    are example b); the privacy unit is the example, so its rows' gradients are summed before
    clipping.
    """
    rows = grad_sample.shape[0]
    if rows == examples:
        return grad_sample
    if examples == 0 or rows % examples:
        raise RuntimeError(f"{rows} per-row gradients do not split into {examples} examples")
    return grad_sample.view(examples, rows // examples, *grad_sample.shape[1:]).sum(dim=1)


def per_sample_norms(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each example's gradient over all given tensors (flat clipping): [B]."""
    # vector_norm in (at least) fp32 rather than .float().pow(2): no per-sample-sized temporary
    # (Opacus's form); a float64 model's gradients are not narrowed (vector_norm refuses that)
    norms = [torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.promote_types(g.dtype, torch.float32))
             for g in per_sample]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms], dim=0), dim=0)


# Clipping rules: per-example scale factor from the per-example norm, each of sensitivity C (the
# clipped example's norm, ||f g||): "flat" is Abadi et al.'s min(1, C/||g||) (Opacus's form, with its
# 1e-6 guard): min(||g||, C); "automatic" (Auto-S / NSGD) C ||g|| / (||g|| + gamma) < C; "psac"
# C ||g|| / (||g|| + gamma / (||g|| + gamma)) < C.
CLIP_FACTORS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "flat": lambda norms, c, gamma: (c / (norms + 1e-6)).clamp(max=1.0),
    "automatic": lambda norms, c, gamma: c / (norms + gamma),
    "psac": lambda norms, c, gamma: c / (norms + gamma / (norms + gamma)),
}


PER_LAYER = "per_layer"  # a threshold C_l per parameter tensor instead of one rule on the whole norm
CLIPPING_RULES = (*CLIP_FACTORS, PER_LAYER)  # privacy.clipping's choices

# privacy.per_layer_thresholds: how C is split into C_l (public quantities only, never gradients).
# equal: C_l = C / sqrt(L). init_norm: C_l ∝ ‖θ_l⁰‖, the parameter's norm when the algorithm is built
# (public when the initial weights are: pretrained on public data, or drawn from the seed); a
# parameter that starts at zero (a bias) gets the smallest non-zero parameter's share, so it can learn.
LAYER_THRESHOLDS = ("equal", "init_norm")


def layer_thresholds(params: list[torch.Tensor], clip_norm: float, rule: str = "equal") -> torch.Tensor:
    """C_l for each of `params` (fp64 [L], on the CPU) by `rule` (LAYER_THRESHOLDS), with
    Σ_l C_l² = C² to within fp64 rounding and never above it (scaled down by 8 ulps)."""
    if rule == "equal":
        weights = torch.ones(len(params), dtype=torch.float64)
    elif rule == "init_norm":
        weights = torch.tensor([float(torch.linalg.vector_norm(p.detach().double())) for p in params],
                               dtype=torch.float64)
        nonzero = weights[weights > 0]
        # zero-initialised parameters would never move: the smallest non-zero share (all zero: equal)
        weights = torch.where(weights > 0, weights, nonzero.min() if len(nonzero) else torch.ones((), dtype=torch.float64))
    else:
        raise ValueError(f"unknown per-layer threshold rule {rule!r}; one of {LAYER_THRESHOLDS}")
    return clip_norm * weights / torch.linalg.vector_norm(weights) * (1.0 - 8 * UNIT_ROUNDOFF[torch.float64])


def layer_norms(norm_sq: list[torch.Tensor]) -> torch.Tensor:
    """[L, B] fp32 per-layer clip norms from each layer's per-example squared-norm bounds (fp64 [B]
    each): clamped at 0, square-rooted and rounded up, so each is ≥ the bound's square root."""
    stacked = torch.stack([s.double() for s in norm_sq], dim=0)
    return round_up_fp32(stacked.clamp(min=0).sqrt() * fp64_slack(2))


def per_sample_layer_norms(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """[L, B] upper bounds on each example's gradient norm in each tensor (rounding included:
    rounding.py's sum-of-squares bound), for per-layer clipping of materialised gradients."""
    return layer_norms([_sum_of_squares(g) for g in per_sample])


def per_layer_factors(norms: torch.Tensor, thresholds: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Factors [L, B] of per-layer clipping: min(1, C_l / (‖g_{i,l}‖ + 1e-6)) rounded down, so that
    f_{i,l} · ‖g_{i,l}‖ ≤ C_l exactly when `norms` bound the norms (Σ_l C_l² ≤ C²: the example's
    contribution has norm ≤ C). An example with a non-finite norm in any layer, or that `keep` ([B]
    bool) leaves out, gets 0 in every layer."""
    ratio = thresholds.to(device=norms.device, dtype=torch.float64).view(-1, 1) / (norms.double() + 1e-6)
    factors = round_down_fp32(ratio * (1.0 - 4 * UNIT_ROUNDOFF[torch.float64])).clamp(max=1.0)
    kept = torch.isfinite(norms).all(dim=0)
    kept = kept if keep is None else kept & keep
    return torch.where(kept.view(1, -1), factors, torch.zeros_like(factors))


def clip_factors(norms: torch.Tensor, clip_norm: float | torch.Tensor, rule: str = "flat", gamma: float = 0.01,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example factors [B] of `rule` at `clip_norm` (a float, or one bound per example); 0 for
    an example whose norm is non-finite or that `keep` ([B] bool) leaves out, > 0 for every other.

    `keep` drops an example from every part of a release at once (DPDR's alpha and orthogonal
    parts: a NaN gradient must not be kept in one part because only the other's norm saw it)."""
    factors = CLIP_FACTORS[rule](norms, clip_norm, gamma)
    kept = torch.isfinite(norms) if keep is None else torch.isfinite(norms) & keep
    # A NaN/inf gradient from one example must not poison the sum: it contributes nothing.
    return torch.where(kept, factors, torch.zeros_like(factors))


def scale_rows(values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """f_i · v_i for per-example rows [B, ...]: a row whose factor is 0 is selected as zeros,
    not multiplied (its values may be NaN or inf, and 0 · NaN is NaN)."""
    shape = (-1, *([1] * (values.dim() - 1)))
    scaled = values * factors.to(values.dtype).view(shape)
    return torch.where((factors != 0).view(shape), scaled, torch.zeros((), dtype=scaled.dtype, device=scaled.device))


def clipped_sum(per_sample: list[torch.Tensor], factors: torch.Tensor, overwrite: bool = False) -> list[torch.Tensor]:
    """sum_i factor_i * g_i for each tensor, accumulated in float32; `factors` [B] (one per example)
    or [L, B] (per-layer clipping: row l for tensor l).

    A non-finite example has factor 0, but 0 · inf is NaN: its entries are first replaced by zeros
    (nan_to_num, a select; an example with a finite norm has no such entry to replace). With
    `overwrite=True` (the caller drops the per-sample tensors afterwards) fp32 tensors are zeroed
    in place, so no per-sample-sized copy is made."""
    factors = factors.float()
    sums = []
    for index, g in enumerate(per_sample):
        row = factors[index] if factors.dim() == 2 else factors
        finite = torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0) if overwrite and g.dtype == torch.float32 else \
            torch.nan_to_num(g.float(), nan=0.0, posinf=0.0, neginf=0.0)
        sums.append(torch.einsum("b,b...->...", row, finite))
    return sums


# (one parameter's full-size clipped sum, the parameter's position in the engine's `params`) -> what is kept of it
Reduce = Callable[[torch.Tensor, int], torch.Tensor]


def reduce_each(sums: list[torch.Tensor], reduce: Reduce | None) -> list[torch.Tensor]:
    """`reduce` applied to each sum in order (train.sharding=fsdp: `distributed.reduce_scatter_rows`,
    a collective every rank enters alike), each full-size sum dropped from `sums` once reduced.
    `reduce` None: `sums` itself."""
    if reduce is None:
        return sums
    kept = []
    while sums:
        kept.append(reduce(sums.pop(0), len(kept)))
    return kept


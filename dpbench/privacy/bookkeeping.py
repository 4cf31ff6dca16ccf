"""Book-keeping (Bu et al., ICML 2023) and ghost clipping without per-example gradients.

`algo.per_sample=bk`: one backward pass of the summed loss. Hooks keep, for each trainable layer,
what its per-example gradient is made of, then each example's norm, the clip factors f_i and the
clipped sum Σ_i f_i G_i in one matmul per layer:

* Linear over [B, T, in] (T = all middle positions): input a_i [T, in], output gradient g_i
  [T, out], G_i = g_iᵀ a_i. ‖G_i‖² = Σ_{t,s} (a_i a_iᵀ)_{ts} (g_i g_iᵀ)_{ts} (ghost norm, T² per
  example) when T² < in·out, else from the instantiated G_i; the layer keeps (a, g) when
  T·(in+out) < in·out, else G_i, whichever is smaller (fastDP's "mixed" choice). Clipped sum:
  (f ⊙ g)ᵀ a over all B·T rows.
* A Linear with a gradient map (DP-GRAPE): the same with (a, gP) or (aP, g), so the projected
  per-example gradient is never formed unless that is the smaller form.
* Embedding: token ids and g; ghost norm through equal-id pairs; clipped sum by index_add.
* LayerNorm (timm's too): per-example [B, d] weight and bias gradients, x̂ recomputed from the
  saved input (instantiated: d numbers per example).
* Any other layer (GroupNorm, Conv2d, DP-ViT's token embedding, ...): its per-example
  gradient instantiated by Opacus's grad sampler (functorch for layers Opacus does not know).
  Their per-example gradients are small in the models here (norm scales, biases, small convs),
  so the instantiated form is the cheap one and the hand-written ghost forms are not needed.

`algo.per_sample=ghost`: the same hooks in a first backward keep nothing but each example's squared
norm (one layer's working set at a time); a second backward through the same graph rebuilds each
layer's pieces and sums f_i G_i in fp32 as they arrive, capped per parameter at the norm the first
pass measured (so the bound holds even if the GPU's kernels are not deterministic). Opacus's ghost
clipping instead backpropagates Σ_i f_i ℓ_i with autograd, which under autocast sums in bf16.

Every piece's squared norm is an upper bound that covers its own rounding (N̂_i + E_i, E_i bounding
|N̂_i − ‖G_i‖²| for the arithmetic used): the Gram identities cancel when an example's tokens do.
README, "Rounding and the clip norm".

Both engines check once, against autograd's own summed gradient, that every trainable parameter's
gradient is made only of what the hooks saw (a parameter read outside its module's forward would
otherwise be released without a per-example norm), and give a non-finite example clip factor 0.

Written by hand because Opacus 1.6 has no book-keeping and its ghost clipping sums in low
precision. Rows that belong to one example (candidate scoring: R = K·B rows, example-major) are
merged into the token axis, which is exact for these layers: the example's gradient sums over its
rows and tokens alike. A parameter used by several layer calls (tied or reused) has the norm of
its summed per-example gradient, not the parts' norms: calls of one layer kind concatenate their
tokens; an output layer tied to the input embedding keeps both parts and adds their cross term
(`TiedPieces`); anything else is instantiated and summed.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from functools import partial
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dpbench.errors import UserError
from dpbench.privacy.clipping import clipped_sum, sum_rows_per_example

FactorsFn = Callable[[torch.Tensor], torch.Tensor]


class LinearGradientMap(Protocol):
    """A linear map applied to a Linear layer's per-example weight gradients (DP-GRAPE's projection).

    `pair(a, g)` -> (a', g') with mapped G_i = Σ_t g'_tᵀ a'_t; `map_gradient(param, grad)` maps a
    summed gradient of the layer's parameter (identity for the bias)."""

    def pair(self, activations: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def map_gradient(self, param: nn.Parameter, gradient: torch.Tensor) -> torch.Tensor: ...


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scaled_rows(g: torch.Tensor, factors: torch.Tensor, all_finite: bool = False, in_place: bool = False) -> torch.Tensor:
    """f_i · g_i in fp32 (one new tensor: bf16 · fp32 promotes in the product; `in_place`: into an
    fp32 g nothing else reads), rows with f_i = 0 zeroed in place so that 0 · inf cannot poison the
    sum (unless `all_finite`: no f_i is 0)."""
    factors = factors.float().view(-1, *([1] * (g.dim() - 1)))
    scaled = g.mul_(factors) if in_place else torch.mul(g, factors)
    if not all_finite:
        scaled.masked_fill_(factors == 0, 0.0)
    return scaled.float()  # (a float64 model: cast back)


def _keep_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero the examples whose clip factor is 0 (non-finite gradient), so 0 · inf cannot poison
    the sum; materialize's clipped_sum drops them the same way."""
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


# --- rounding bounds of the clip norm ------------------------------------------------------------
# Each piece's `norm_sq()` is N̂_i + E_i in fp64: the computed squared norm plus a bound E_i on
# |N̂_i − ‖G_i‖²| for the arithmetic that computed it, ‖G_i‖ the exact norm of the per-example
# gradient the kept tensors sum to; so it is ≥ ‖G_i‖² however an example's terms cancel (no clamp
# but on the total, `_norms`). Bounds are Higham's: an n-term dot product in unit roundoff u is off
# by at most γ_n Σ_k |x_k y_k| (γ_n = nu / (1 − nu)) in any summation order, with or without FMA.
# README, "Rounding and the clip norm".
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Absolute error of one operation near underflow: the smallest normal number (flush-to-zero included).
UNDERFLOW = {torch.float64: 2.0**-1022, torch.float32: 2.0**-126}
REDUCED_MATMUL_ROUNDING = 2.0**-8  # fp32 matmul inputs under TF32 / bf16 modes: at most 8 significant bits
GRAM_FP32_LIMIT = 1e-2  # γ_width · T beyond which a Gram is formed in fp64 (`_gram_dtype`)


def _gamma(n: int, u: float) -> float:
    """Higham's γ_n = nu / (1 − nu) (inf when nu ≥ 1)."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 1.0 else math.inf


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 for a float64 model's pieces, else fp32 (bf16 and fp16 pieces widen exactly)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _gram_dtype(width: int, tokens: int, *tensors: torch.Tensor) -> torch.dtype:
    """fp32 Gram products over `width` features, unless the bound would inflate a typical norm:
    its E is about γ_width · T · ρ of ‖G‖² (ρ ≈ 0.3 measured, ρ ≤ 1), so beyond γ_width(u₃₂) · T = 1e-2
    (a language model's output layer: width = the vocabulary) a Gram of a is formed in fp64, one of g
    gets the |g| Gram bound (`_gram_norm_sq`)."""
    dtype = _compute_dtype(*tensors)
    if dtype == torch.float32 and _gamma(width, UNIT_ROUNDOFF[torch.float32]) * tokens > GRAM_FP32_LIMIT:
        return torch.float64
    return dtype


def _input_rounding(dtype: torch.dtype) -> float:
    """Relative rounding of an fp32 matmul's inputs when torch may run it reduced (TF32 on CUDA,
    bf16 passes under float32_matmul_precision 'high'/'medium'); private runs set 'highest'."""
    if dtype == torch.float32 and (torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32):
        return REDUCED_MATMUL_ROUNDING
    return 0.0


def _dot_error(n: int, dtype: torch.dtype) -> float:
    """Relative bound of an n-term dot product (a matmul entry) in dtype: |x̂ − x| ≤ this · Σ|x_k y_k|
    (+ the underflow term n · UNDERFLOW): (1 + u_in)² (1 + γ_n) − 1."""
    return (1.0 + _input_rounding(dtype)) ** 2 * (1.0 + _gamma(n, UNIT_ROUNDOFF[dtype])) - 1.0


def _fp64_slack(ops: int) -> float:
    """Covers the fp64 rounding of a bound computed from nonnegative terms `ops` operations deep
    (relative γ_ops(2^-53), doubled)."""
    return 1.0 + 4.0 * ops * UNIT_ROUNDOFF[torch.float64]


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds, fp64, on the exact ‖x_t‖ of the last axis ([B, T, d] -> [B, T]): the computed
    sum of squares is at least (1 − γ_{d+3}) times the exact one, less d underflows."""
    dtype = _compute_dtype(x)
    computed = torch.linalg.vector_norm(x, dim=-1, dtype=dtype).double()
    d = x.shape[-1]
    return ((computed.pow(2) + (d + 2) * UNDERFLOW[dtype]) / (1.0 - _gamma(d + 3, UNIT_ROUNDOFF[dtype]))).sqrt() * _fp64_slack(4)


def _quadratic(left: torch.Tensor, matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Upper bound, fp64 [B], on Σ_ts l_t M_ts r_s for fp64 l, r ≥ 0 [B, T], [B, T'] and M ≥ 0
    [B, T, T'], computed in M's dtype: l and r rounded into it (relative u each) and two sums of
    nonnegative products (T and T' terms), all widened by 1 / (1 − γ_{T+T'+4})."""
    dtype = matrix.dtype
    value = torch.bmm(torch.bmm(left.to(dtype).unsqueeze(1), matrix), right.to(dtype).unsqueeze(2)).view(-1).double()
    return value * ((1.0 + 4 * UNIT_ROUNDOFF[torch.float64]) / (1.0 - _gamma(left.shape[1] + right.shape[1] + 4, UNIT_ROUNDOFF[dtype])))


def _products_sum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """Σ x ⊙ y per example ([B, T, T'] -> [B]): products in their common dtype, summed in fp64 (no
    fp64 copy of x and y). Returns it with (r, t): it is off by at most r Σ|x ⊙ y| + t."""
    products = x * y
    dtype, count = products.dtype, x.shape[1] * x.shape[2]
    u = UNIT_ROUNDOFF[dtype]
    rounding = u + _gamma(count + 1, UNIT_ROUNDOFF[torch.float64]) * (1 + u)
    return products.sum(dim=(1, 2), dtype=torch.float64), rounding, 2 * count * UNDERFLOW[dtype]


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Upper bound, fp64 [B], on the exact Σ x² of each example's [B, ...] tensor: fp32 sums along
    the last axis (relative γ_{last+3}, with the norm's sqrt), then fp64 across rows."""
    dtype = _compute_dtype(x)
    rows = x.reshape(x.shape[0], -1, x.shape[-1] if x.dim() > 1 else 1)
    last, count = rows.shape[2], rows.shape[1]
    computed = torch.linalg.vector_norm(rows, dim=-1, dtype=dtype).double().pow(2).sum(dim=1)
    scale = _fp64_slack(count + 4) / (1.0 - _gamma(last + 3, UNIT_ROUNDOFF[dtype]))
    return computed.add_(count * (last + 2) * UNDERFLOW[dtype]).mul_(scale)


def _exact_arithmetic(device: torch.device):
    """Norms and sums in the dtypes the bounds assume, not autocast's."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _round_up_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp64 -> the nearest fp32 at or above."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def _round_down_fp32(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return torch.where(y.double() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


class Instantiated:
    """Per-example gradients [B, ...] of one parameter."""

    def __init__(self, grad_sample: torch.Tensor):
        self.grad_sample = grad_sample

    def nbytes(self) -> int:
        return _bytes(self.grad_sample)

    def tensors(self) -> list[torch.Tensor]:
        return [self.grad_sample]

    def instantiate(self) -> torch.Tensor:
        return self.grad_sample

    def compact(self, input_readers: int = 1):
        return self

    def norm_sq(self) -> torch.Tensor:
        """Bound: the sum of squares of the tensor that is summed, / (1 − γ_{d+3}) (fp32 along its
        last axis d, fp64 across); its clipped sum's rounding is relative to ‖G_i‖ (not counted)."""
        return _sum_of_squares(self.grad_sample)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        if not all_finite:  # zero the rows of dropped examples first (0 · inf)
            return clipped_sum([self.grad_sample], factors)[0]
        flat = self.grad_sample.reshape(self.grad_sample.shape[0], -1).float()
        return (factors.float() @ flat).view(self.grad_sample.shape[1:])


class OuterProduct:
    """Per-example weight gradients G_i = g_iᵀ a_i [out, in] from a [B, T, in] and g [B, T, out]."""

    def __init__(self, activations: torch.Tensor, backprops: torch.Tensor):
        self.a, self.g = activations, backprops

    def nbytes(self) -> int:
        return _bytes(self.a, self.g)

    def tensors(self) -> list[torch.Tensor]:
        return [self.a, self.g]

    def instantiate(self) -> torch.Tensor:
        return torch.einsum("bto,bti->boi", self.g, self.a)

    def compact(self, input_readers: int = 1):
        """The smaller of (a, g) and the instantiated G_i, by the bytes each adds: an input that
        `input_readers` layers keep (q, k and v read one) costs each of them its share."""
        kept = self.g.numel() * self.g.element_size() + self.a.numel() * self.a.element_size() / max(input_readers, 1)
        instantiated = self.a.shape[0] * self.a.shape[2] * self.g.shape[2] * self.g.element_size()
        return Instantiated(self.instantiate()) if instantiated <= kept else self

    def norm_sq(self) -> torch.Tensor:
        """N̂ + E, N̂ by the Gram identity ‖G_i‖² = Σ_ts (a aᵀ)_ts (g gᵀ)_ts (Grams fp32, or fp64 where
        `_gram_dtype` says, the rest fp64),
        E = ε_in Σ_ts ‖a_t‖‖a_s‖|ĝg_ts| + ε_out Σ_ts ‖g_t‖‖g_s‖|âa_ts| + ε_in ε_out S² + γ_{T²+1}(fp64) Σ|products|
        (ε_n: an n-term dot product's relative bound, S = Σ_t ‖a_t‖‖g_t‖); when T² ≥ in·out, from G_i
        instantiated in fp32, E = (√(N̂/(1 − γ_{in+3})) + ε_T S)² − N̂."""
        estimate, error, _ = self.bounds()
        return estimate + error

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N̂, E, S) per example, fp64."""
        tokens, d_in, d_out = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        return (_instantiated_norm_sq if tokens * tokens >= d_in * d_out else _gram_norm_sq)(self.a, self.g)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        """Σ_i f_i G_i = (f ⊙ g)ᵀ a = gᵀ (f ⊙ a). Rows of dropped examples (f_i = 0: a non-finite
        gradient) are zeroed in a and g, unless `all_finite` says no f_i is 0 (then every row is
        finite). The factors scale g in place when `own_g` says nothing else reads it (book-keeping
        after its backward: no copy, no new memory), else a copy of the narrower of a and g."""
        def unscaled(x):
            return x.float() if all_finite else _keep_rows(x.float(), factors > 0)

        if own_g and self.g.dtype == torch.float32 and self.g.is_contiguous():
            a, g = unscaled(self.a), _scaled_rows(self.g, factors, all_finite, in_place=True)
        elif self.a.shape[2] < self.g.shape[2]:
            a, g = _scaled_rows(self.a, factors, all_finite), unscaled(self.g)
        else:
            a, g = unscaled(self.a), _scaled_rows(self.g, factors, all_finite)
        return g.reshape(-1, g.shape[2]).transpose(0, 1) @ a.reshape(-1, a.shape[2])  # [out, in]

    def merge(self, other: "OuterProduct") -> "OuterProduct":
        """Two calls of one layer: their tokens concatenate (G_i = Σ over both calls)."""
        return OuterProduct(torch.cat([self.a, other.a], dim=1), torch.cat([self.g, other.g], dim=1))


def _gram_weights(gram: torch.Tensor, width: int) -> tuple[torch.Tensor, float]:
    """w_t = √(x̂_tt + t) from a computed Gram's diagonal, in its dtype, and κ with ‖x_t‖ ≤ κ w_t:
    x̂_tt ≥ (1 − ε_width) ‖x_t‖² − t (nonnegative terms), the add and the sqrt round by u each."""
    dtype, u = gram.dtype, UNIT_ROUNDOFF[gram.dtype]
    weights = gram.diagonal(dim1=1, dim2=2).add(2 * width * UNDERFLOW[dtype]).sqrt_()
    return weights, (1.0 + 4 * UNIT_ROUNDOFF[torch.float64]) / ((1.0 - u) ** 1.5 * math.sqrt(1.0 - _dot_error(width, dtype)))


def _gram_norm_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖G_i‖² of G_i = g_iᵀ a_i by the Gram identity: (N̂, E, S) per example, fp64. The Grams are
    formed in fp32 (fp64 for a float64 model or a wide side, `_gram_dtype`), their products (exact:
    products in fp32) summed in fp64. With x̂ = âa_ts, ŷ = ĝg_ts the computed Grams,
    |x̂ − x| ≤ e_a α_ts + t_a, |ŷ − y| ≤ e_g β_ts + t_g (α_ts = ‖a_t‖‖a_s‖, β_ts = ‖g_t‖‖g_s‖, e the dot
    products' relative bounds, t their underflow), so |x̂ŷ − xy| ≤ (e_a α + t_a)|ŷ| + |x̂|(e_g β + t_g)
    + (e_a α + t_a)(e_g β + t_g); products and sum add (u + γ_{T²+1}(fp64)) Σ|x̂ŷ|, Σ|x̂ŷ| ≤ (1 + e_a) Σ α|ŷ| + t_a Σ|ŷ|."""
    (tokens, d_in), d_out = a.shape[1:], g.shape[2]
    dtype_a, dtype_g = _gram_dtype(d_in, tokens, a, g), _gram_dtype(d_out, tokens, a, g)
    # A wide output side (the vocabulary): its Gram stays fp32 and the bound takes the Gram of |g|
    # (|ŷ − y| ≤ e_g |g_t|·|g_s|: small for softmax gradients), one more fp32 product instead of fp64.
    wide_g = dtype_g != _compute_dtype(a, g)
    dtype_g = _compute_dtype(a, g) if wide_g else dtype_g
    a_, g_ = a.to(dtype_a), g.to(dtype_g)
    gram_a = torch.bmm(a_, a_.transpose(1, 2))  # [B, T, T]
    gram_g = torch.bmm(g_, g_.transpose(1, 2))
    estimate, rounding, underflow = _products_sum(gram_a, gram_g)
    (w_a, k_a), (w_g, k_g) = _gram_weights(gram_a, d_in), _gram_weights(gram_g, d_out)  # ‖a_t‖ ≤ k_a w_a,t
    e_a, e_g = _dot_error(d_in, dtype_a), _dot_error(d_out, dtype_g)
    t_a, t_g = 2 * d_in * UNDERFLOW[dtype_a], 2 * d_out * UNDERFLOW[dtype_g]  # underflow: absolute per entry
    area = tokens * tokens
    # Σ_ts α|ŷ| and Σ_ts β|x̂| (in each Gram's dtype, widened for their own rounding)
    quadratic = 1.0 / (1.0 - _gamma(2 * tokens + 4, max(UNIT_ROUNDOFF[dtype_a], UNIT_ROUNDOFF[dtype_g])))
    weighted_a = torch.bmm(torch.bmm(w_a.to(dtype_g).unsqueeze(1), gram_g.abs()), w_a.to(dtype_g).unsqueeze(2)).view(-1).double()
    weighted_g = torch.bmm(torch.bmm(w_g.to(dtype_a).unsqueeze(1), gram_a.abs()), w_g.to(dtype_a).unsqueeze(2)).view(-1).double()
    weighted_a, weighted_g = weighted_a * (quadratic * k_a * k_a), weighted_g * (quadratic * k_g * k_g)
    if wide_g:  # Σ_ts (|g_t|·|g_s|) |x̂_ts|: nonnegative fp32 sums and products, widened
        magnitude = g_.abs()
        absolute = torch.bmm(magnitude, magnitude.transpose(1, 2)).to(dtype_a).mul_(gram_a.abs()).sum(dim=(1, 2), dtype=torch.float64)
        widen = (1 + UNIT_ROUNDOFF[dtype_a]) * (1 + 2 * UNIT_ROUNDOFF[dtype_g]) / ((1 - _dot_error(d_out, dtype_g)) * (1 - _gamma(area + 1, UNIT_ROUNDOFF[torch.float64])))
        weighted_g = torch.minimum(weighted_g, absolute * widen)
    w_a, w_g = w_a.double() * k_a, w_g.double() * k_g
    spread = (w_a * w_g).sum(dim=1)  # S = Σ_t ‖a_t‖‖g_t‖ (bound)
    alpha, beta = w_a.sum(dim=1).square(), w_g.sum(dim=1).square()  # Σ_ts α_ts, Σ_ts β_ts
    abs_g = (1 + e_g) * beta + area * t_g  # ≥ Σ|ŷ|
    error = ((e_a + rounding * (1 + e_a)) * weighted_a + e_g * weighted_g + e_a * e_g * spread.square()
             + (t_a * (1 + rounding)) * abs_g + t_g * ((1 + e_a) * alpha + area * t_a)
             + e_a * t_g * alpha + t_a * e_g * beta + area * t_a * t_g + underflow)
    return estimate, error * _fp64_slack(area + 16), spread * _fp64_slack(tokens + 4)


def _instantiated_norm_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖G_i‖² from G_i instantiated in fp32 (fp64 for a float64 model): ‖Ĝ_i − G_i‖ ≤ e_T S (+ underflow),
    so ‖G_i‖² ≤ (√U(Ĝ) + e_T S)², returned as (N̂, that bound − N̂, S)."""
    dtype, tokens = _compute_dtype(a, g), a.shape[1]
    instantiated = torch.einsum("bto,bti->boi", g.to(dtype), a.to(dtype))
    estimate = torch.linalg.vector_norm(instantiated.flatten(1), dim=1, dtype=torch.float64).pow(2)
    spread = (_row_norms(a) * _row_norms(g)).sum(dim=1) * _fp64_slack(tokens + 4)
    entries = instantiated[0].numel()
    off = _dot_error(tokens, dtype) * spread + 2 * tokens * UNDERFLOW[dtype] * math.sqrt(entries)
    bound = ((_sum_of_squares(instantiated).sqrt() + off).pow(2)) * _fp64_slack(4)
    return estimate, bound - estimate, spread


class EmbeddingRows:
    """Per-example gradients of an embedding table [V, d] from token ids [B, T] and g [B, T, d]."""

    def __init__(self, ids: torch.Tensor, backprops: torch.Tensor, num_embeddings: int):
        self.ids, self.g, self.num_embeddings = ids, backprops, num_embeddings

    def nbytes(self) -> int:
        return _bytes(self.ids, self.g)

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.g]

    def instantiate(self) -> torch.Tensor:
        batch, _, dim = self.g.shape
        grads = torch.zeros((batch, self.num_embeddings, dim), dtype=self.g.dtype, device=self.g.device)
        return grads.scatter_add_(1, self.ids.unsqueeze(-1).expand(-1, -1, dim), self.g)

    def compact(self, input_readers: int = 1):
        tokens, dim = self.ids.shape[1], self.g.shape[2]
        return Instantiated(self.instantiate()) if self.num_embeddings * dim <= tokens * (dim + 1) else self

    def norm_sq(self) -> torch.Tensor:
        """N̂ + E, N̂ = Σ_ts [id_t = id_s] (g gᵀ)_ts (Gram fp32, the rest fp64),
        E = ε_d Q + γ_{T²+1}(fp64) Σ_same |ĝg_ts| with Q = Σ_same ‖g_t‖‖g_s‖."""
        estimate, error, _ = self.bounds()
        return estimate + error

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N̂, E, Q) per example, fp64."""
        tokens, dim = self.g.shape[1:]
        dtype = _gram_dtype(dim, tokens, self.g)
        g = self.g.to(dtype)
        same_row = (self.ids.unsqueeze(2) == self.ids.unsqueeze(1)).to(dtype)  # [B, T, T]
        gram = torch.bmm(g, g.transpose(1, 2))
        estimate, rounding, underflow = _products_sum(same_row, gram)  # (× 0 or 1: exact)
        weights, scale = _gram_weights(gram, dim)
        spread = _quadratic(weights.double() * scale, same_row, weights.double() * scale)  # Q ≥ Σ_same ‖g_t‖‖g_s‖
        e, t = _dot_error(dim, dtype), 2 * dim * UNDERFLOW[dtype]
        area = tokens * tokens
        error = e * spread + t * area + rounding * ((1 + e) * spread + t * area) + underflow
        return estimate, error * _fp64_slack(area + 8), spread

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        g = _scaled_rows(self.g, factors, all_finite)
        table = torch.zeros((self.num_embeddings, g.shape[2]), dtype=torch.float32, device=g.device)
        return table.index_add_(0, self.ids.reshape(-1), g.reshape(-1, g.shape[2]))

    def merge(self, other: "EmbeddingRows") -> "EmbeddingRows":
        return EmbeddingRows(torch.cat([self.ids, other.ids], 1), torch.cat([self.g, other.g], 1), self.num_embeddings)


def _ties(outer: OuterProduct, rows: EmbeddingRows) -> bool:
    """An output layer [V, d] (g: [B, T, V], a: [B, T, d]) and an embedding table [V, d]."""
    return outer.g.shape[2] == rows.num_embeddings and outer.a.shape[2] == rows.g.shape[2]


def _outer_embedding_cross(outer: OuterProduct, rows: EmbeddingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """⟨g_iᵀ a_i, E_i⟩ per example for an output layer [V, d] tied to an embedding table [V, d]
    (E_i[v] = Σ_{s: id_s = v} g'_s): Σ_{t,s} g_t[id_s] (a_t · g'_s), a [B, T, T'] product instead
    of two [B, V, d] per-example tables. With its error bound (fp64, not clamped):
    ε_d W + t_d Σ|g_t[id_s]| + (u + γ_{TT'+1}(fp64)) ((1 + ε_d) W + …), W = Σ_ts |g_t[id_s]| ‖a_t‖‖g'_s‖."""
    tokens, others, dim = outer.g.shape[1], rows.g.shape[1], outer.a.shape[2]
    dtype = _gram_dtype(dim, max(tokens, others), outer.a, rows.g)
    picked = outer.g.gather(2, rows.ids.unsqueeze(1).expand(-1, tokens, -1)).to(dtype)  # g_t[id_s]: [B, T, T'] (exact)
    inner = torch.bmm(outer.a.to(dtype), rows.g.to(dtype).transpose(1, 2))
    cross, rounding, underflow = _products_sum(picked, inner)
    magnitude = picked.abs()
    weighted = _quadratic(_row_norms(outer.a), magnitude, _row_norms(rows.g))
    total = magnitude.sum(dim=(1, 2), dtype=torch.float64) * _fp64_slack(tokens * others)
    e, t = _dot_error(dim, dtype), 2 * dim * UNDERFLOW[dtype]
    error = e * weighted + t * total + rounding * ((1 + e) * weighted + t * total) + underflow
    return cross, error * _fp64_slack(16)


class TiedPieces:
    """One parameter read by layers of different kinds (a language model's output layer tied to
    its input embedding): the parts kept apart, ‖Σ_k G_k‖² = Σ_k ‖G_k‖² + 2 Σ_{j<k} ⟨G_j, G_k⟩
    with the cross terms in ghost form, so no per-example table is formed unless it is smaller."""

    def __init__(self, outer: OuterProduct, rows: EmbeddingRows):
        self.outer, self.rows = outer, rows

    def nbytes(self) -> int:
        return self.outer.nbytes() + self.rows.nbytes()

    def tensors(self) -> list[torch.Tensor]:
        return self.outer.tensors() + self.rows.tensors()

    def instantiate(self) -> torch.Tensor:
        return self.outer.instantiate() + self.rows.instantiate()

    def compact(self, input_readers: int = 1):
        batch, vocab, dim = self.rows.g.shape[0], self.rows.num_embeddings, self.rows.g.shape[2]
        return Instantiated(self.instantiate()) if batch * vocab * dim * self.rows.g.element_size() <= self.nbytes() else self

    def norm_sq(self) -> torch.Tensor:
        """The parts' N̂ + 2·cross, plus the parts' E and twice the cross term's (a signed estimate:
        nothing clamped but the total)."""
        outer_estimate, outer_error, _ = self.outer.bounds()
        rows_estimate, rows_error, _ = self.rows.bounds()
        cross, cross_error = _outer_embedding_cross(self.outer, self.rows)
        terms = [outer_estimate, rows_estimate, 2 * cross, outer_error, rows_error, 2 * cross_error]
        # fp64 rounding of adding signed terms: relative to the terms, not to their (cancelling) sum
        return sum(terms) + 8 * UNIT_ROUNDOFF[torch.float64] * sum(t.abs() for t in terms)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        return self.outer.clipped_sum(factors, all_finite) + self.rows.clipped_sum(factors, all_finite)

    def merge(self, other):
        """A third call of the parameter: joined to the part of its kind."""
        if isinstance(other, OuterProduct):
            return TiedPieces(self.outer.merge(other), self.rows)
        if isinstance(other, EmbeddingRows):
            return TiedPieces(self.outer, self.rows.merge(other))
        raise RuntimeError("not a part of this tie")


def _tie(first, second):
    """TiedPieces for an output layer and an embedding sharing one table, else None."""
    for outer, rows in ((first, second), (second, first)):
        if isinstance(outer, OuterProduct) and isinstance(rows, EmbeddingRows) and _ties(outer, rows):
            return TiedPieces(outer, rows)
    return None


def _merge(first, second):
    if (type(first) is type(second) or isinstance(first, TiedPieces)) and hasattr(first, "merge"):
        try:
            return first.merge(second)
        except RuntimeError:  # shapes that do not concatenate: fall through to instantiation
            pass
    tied = _tie(first, second)
    if tied is not None:
        return tied
    return Instantiated(first.instantiate() + second.instantiate())


def _tokens(x: torch.Tensor, examples: int) -> torch.Tensor:
    """[R, ..., d] -> [B, T, d]: every position of an example's rows becomes a token."""
    return x.reshape(examples, -1, x.shape[-1])


def _linear_pieces(module: nn.Linear, activations, backprops, examples: int, gradient_map) -> dict:
    a = _tokens(activations[0].to(backprops.dtype), examples)
    g = _tokens(backprops, examples)
    pieces = {}
    if module.bias is not None and module.bias.requires_grad:
        pieces[module.bias] = Instantiated(g.sum(dim=1, dtype=torch.float32))  # bf16 rows: summed and kept in fp32
    if module.weight.requires_grad:
        if gradient_map is not None:
            a, g = gradient_map.pair(a, g)
        pieces[module.weight] = OuterProduct(a, g)
    return pieces


def _embedding_pieces(module: nn.Embedding, activations, backprops, examples: int) -> dict:
    ids = activations[0].reshape(examples, -1)
    g = _tokens(backprops, examples)
    if module.padding_idx is not None:  # the padding row gets no gradient
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {module.weight: EmbeddingRows(ids, g, module.num_embeddings)} if module.weight.requires_grad else {}


# LayerNorm classes whose forward is F.layer_norm over `normalized_shape` (timm's adds a fused-kernel
# option). Opacus looks samplers up by exact type and sends any other class whole to functorch,
# whose vmap holds a layer norm's forward and backward for the whole batch at once: 245 MiB of the
# ViT shape's peak came from timm's LayerNorm there. Names, not classes: timm stays unimported.
LAYER_NORMS = frozenset({"torch.nn.modules.normalization.LayerNorm", "timm.layers.norm.LayerNorm"})


def is_layer_norm(module: nn.Module) -> bool:
    kind = type(module)
    return f"{kind.__module__}.{kind.__qualname__}" in LAYER_NORMS


def _layer_norm_pieces(module: nn.LayerNorm, activations, backprops, examples: int) -> dict:
    """Per-example gradients of a LayerNorm's weight Σ_t x̂_t ⊙ g_t and bias Σ_t g_t, [B, *shape]
    (fp32): x̂ recomputed from the saved input, an example's rows and positions summed at once."""
    shape = tuple(module.normalized_shape)
    g = backprops.reshape(examples, -1, *shape).float()
    pieces = {}
    if module.weight is not None and module.weight.requires_grad:
        normed = F.layer_norm(activations[0].reshape(examples, -1, *shape).float(), shape, eps=module.eps)
        pieces[module.weight] = Instantiated(normed.mul_(g).sum(dim=1))  # normed is new: no copy
    if module.bias is not None and module.bias.requires_grad:
        pieces[module.bias] = Instantiated(g.sum(dim=1))
    return pieces


def _plain_embedding(module: nn.Module) -> bool:
    return type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def _instantiated_pieces(sampler, module, activations, backprops, examples: int) -> dict:
    grads = sampler(module, activations, backprops)
    return {p: Instantiated(sum_rows_per_example(gs, examples)) for p, gs in grads.items() if p.requires_grad}


def _hooked_modules(model: nn.Module, overrides: dict) -> list[nn.Module]:
    """Modules that own trainable parameters, as Opacus walks them: a module without a known
    per-sample rule is handed whole to functorch, so its children are not walked."""
    found = []

    def walk(module):
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        known = module in overrides or type(module) in (nn.Linear, nn.Embedding) or is_layer_norm(module) \
            or type(module) in GradSampleModule.GRAD_SAMPLERS
        if own:
            found.append(module)
            if not known:
                return
        for child in module.children():
            walk(child)

    walk(model)
    return found


class BookKeeping:
    """Clipped per-example gradient sums from layer inputs and output gradients (see module doc).

    `passes=1` is book-keeping; `passes=2` is ghost clipping (norms, then a second backward whose
    hooks sum the clipped pieces in fp32). `overrides` maps module instances to a
    `LinearGradientMap` (Linear layers) or to an Opacus-signature grad sampler (instantiated form)."""

    def __init__(self, model: nn.Module, overrides: dict | None = None, passes: int = 1):
        self.model = model
        self.overrides = dict(overrides or {})
        self.passes = passes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.modules = _hooked_modules(model, self.overrides)
        # Layers without a rule or an Opacus sampler go whole through functorch (all their
        # parameters, children included), as in Opacus.
        self._functorch = {
            m for m in self.modules
            if m not in self.overrides and not self._has_rule(m) and type(m) not in GradSampleModule.GRAD_SAMPLERS
        }
        for module in self._functorch:
            prepare_layer(module)
        self._activations: dict[nn.Module, list] = {}
        self._replay: dict[nn.Module, list] = {}  # ghost: activations again for the second backward
        self._pending: dict[nn.Parameter, int] = {}
        self._calls: dict[nn.Parameter, int] = {}
        self._open: dict[nn.Parameter, object] = {}  # pieces awaiting more calls of their parameter
        self._kept: dict[nn.Parameter, object] = {}  # book-keeping: pieces for the clipped sum
        self._norm_sq: dict[nn.Parameter, torch.Tensor] = {}
        self._summed: dict[nn.Parameter, torch.Tensor] = {}  # ghost's second pass, or the coverage check
        self._factors: torch.Tensor | None = None  # set while the second pass sums
        self._entry_edges: list[tuple] = []  # bottom layers' calls: (module, its inputs, its output's edge)
        self._readers: dict[int, int] = {}  # layers reading each input storage in this forward
        self._held: set[int] = set()  # storages of the kept pieces (a shared input is held once)
        self._examples = 0
        self._held_bytes = 0
        self._coverage_checked = False
        self.tolerance = 1e-4  # coverage check; low precision (autocast) rounds autograd's own sums more
        self.working_bytes = 0  # per-example bytes held at the peak of the last backward
        self.peak_bytes = 0  # ... of any backward (what the run reports)
        self._enabled = True
        self._handles = []
        for module in self.modules:
            self._handles.append(module.register_forward_hook(self._capture_activations))

    def _has_rule(self, module) -> bool:
        override = self.overrides.get(module)
        return hasattr(override, "pair") or type(module) is nn.Linear or _plain_embedding(module) or is_layer_norm(module)

    # --- hooks ---------------------------------------------------------------------------
    def _capture_activations(self, module, inputs, output):
        """Forward hook: keep the layer's inputs and ask for its output's gradient. A pre-hook on
        the output's autograd node rather than a full module backward hook, which wraps every input
        and output of the layer in an extra autograd node."""
        if not (self._enabled and torch.is_grad_enabled()):
            return
        activations = [t.detach() for t in inputs]
        self._activations.setdefault(module, []).append(activations)
        if inputs and torch.is_tensor(inputs[0]):
            storage = _storage(inputs[0])
            self._readers[storage] = self._readers.get(storage, 0) + 1
        for p in module.parameters(recurse=module in self._functorch):
            if p.requires_grad:
                self._pending[p] = self._pending.get(p, 0) + 1
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_tensor(first) and first.grad_fn is not None:
            # On the node that made the output, not on the tensor: an in-place change of the
            # output after this forward would hand a tensor hook the gradient of the changed value.
            first.grad_fn.register_prehook(partial(self._capture_backprops, module, first.output_nr))
            if not any(torch.is_tensor(t) and t.requires_grad for t in inputs):
                self._entry_edges.append((module, activations, get_gradient_edge(first)))

    def _capture_backprops(self, module, index, output_grads):
        if self._enabled and output_grads[index] is not None:
            self._take(module, self._activations[module].pop(), output_grads[index])

    def _take(self, module, activations, output_grad) -> None:
        """One layer call's input and output gradient: its pieces, closed when its parameters'
        last call is in."""
        if self.passes == 2 and self._factors is None:
            self._replay.setdefault(module, []).append(activations)
        backprops = output_grad.detach()
        for p, piece in self._pieces(module, activations, backprops).items():
            self._open[p] = piece if p not in self._open else _merge(self._open[p], piece)
            self._pending[p] -= 1
            if self._pending[p] == 0:
                self._close(p)

    def _pieces(self, module, activations, backprops) -> dict:
        override = self.overrides.get(module)
        if hasattr(override, "pair"):
            return _linear_pieces(module, activations, backprops, self._examples, override)
        if override is None and type(module) is nn.Linear:
            return _linear_pieces(module, activations, backprops, self._examples, None)
        if override is None and _plain_embedding(module):
            return _embedding_pieces(module, activations, backprops, self._examples)
        if override is None and is_layer_norm(module):
            return _layer_norm_pieces(module, activations, backprops, self._examples)
        sampler = override or GradSampleModule.GRAD_SAMPLERS.get(type(module), ft_compute_per_sample_gradient)
        return _instantiated_pieces(sampler, module, activations, backprops, self._examples)

    def _backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate to every layer's output, computing no weight gradient.

        autograd is asked for the gradients of the bottom layers' outputs (layers none of whose
        inputs requires grad), at the nodes that made them: every other layer's backward runs (its
        hook fires) and nothing below those outputs does, so not even the bottom layers' weight
        gradients are formed. That matters for a tied table: asking for the input embedding's
        gradient (`backward_through_layers`, the materialize engine's way) also computes the tied
        output layer's [V, d] weight gradient, a matmul as large as its input gradient's. The bottom
        layers' own hooks do not fire (their nodes do not run): their output gradients come back
        from autograd instead. No bottom layer (the data itself requires grad): a full backward."""
        if not self._entry_edges:
            loss.backward(retain_graph=retain_graph)
            return
        for module, activations, _ in self._entry_edges:
            # Off the stacks first: a layer also called on a hidden state pops only that call's inputs.
            stack = self._activations.get(module, [])
            index = next((i for i, kept in enumerate(stack) if kept is activations), None)
            if index is not None:
                del stack[index]
        edges = [edge for _, _, edge in self._entry_edges]
        grads = torch.autograd.grad(loss, edges, retain_graph=retain_graph, allow_unused=True)
        for (module, activations, _), grad in zip(self._entry_edges, grads):
            if grad is not None:  # (None: the call's output did not reach the loss)
                self._take(module, activations, grad)

    def _close(self, p: nn.Parameter) -> None:
        """All calls of p are in: its squared norms and, by pass, what is kept of it."""
        piece = self._open.pop(p)
        if self._factors is not None:  # ghost's second pass: this parameter's clipped sum, now
            self._summed[p] = self._second_pass_sum(p, piece)
            self.working_bytes = max(self.working_bytes, piece.nbytes() + self._open_bytes())
            return
        if not self._coverage_checked:  # unclipped sum, compared with autograd's (first call only)
            self._summed[p] = piece.clipped_sum(torch.ones(self._examples, device=piece_device(piece)))
        if self.passes == 1:
            piece = piece.compact(self._readers.get(_storage(piece.a), 1) if isinstance(piece, OuterProduct) else 1)
        with _exact_arithmetic(piece_device(piece)):
            self._norm_sq[p] = piece.norm_sq()
        transient = piece.nbytes()
        if self.passes == 1:
            self._kept[p] = piece
            self._held_bytes += _new_bytes(piece.tensors(), self._held)
            transient = 0
        self.working_bytes = max(self.working_bytes, self._held_bytes + transient + self._open_bytes())

    def _second_pass_sum(self, p: nn.Parameter, piece) -> torch.Tensor:
        """Σ_i f_i G_i for one parameter from the second backward's piece, in fp32.

        The second backward recomputes G_i; on a deterministic backend it is bit for bit the one
        whose norm the first pass measured. Where kernels are not deterministic (atomics on a GPU)
        each parameter's contribution is capped at the norm measured in the first pass, so that
        Σ_p ‖f_i G_{i,p}‖² ≤ f_i² ‖G_i‖² ≤ C² holds whatever the kernels did; a row that turned
        non-finite is dropped. Both norms are the pieces' upper bounds (rounding included), and the cap
        is rounded down."""
        with _exact_arithmetic(piece_device(piece)):
            measured, again = self._norm_sq[p], piece.norm_sq()
            finite = torch.isfinite(again)
            cap = torch.where(again > measured, (measured / again.clamp(min=1e-300)).sqrt() * (1 - 4 * UNIT_ROUNDOFF[torch.float64]),
                              torch.ones_like(again))
            cap = _round_down_fp32(torch.where(finite, cap, torch.zeros_like(cap)))
            return piece.clipped_sum(self._factors * cap)

    def _open_bytes(self) -> int:
        return sum(piece.nbytes() for piece in self._open.values())

    # --- the engine interface -----------------------------------------------------------------
    def clipped_sum(self, losses: torch.Tensor, factors_fn: FactorsFn) -> list[torch.Tensor]:
        """Σ_i f_i g_i (fp32, aligned with `params`) for per-example losses [B]; `peak_bytes`
        meters the per-example working bytes held at the peak."""
        self._examples = losses.shape[0]
        self.working_bytes = self._held_bytes = 0
        try:
            self._calls = dict(self._pending)
            keep_graph = self.passes == 2
            if self._coverage_checked:
                self._backward(losses.sum(), retain_graph=keep_graph)
            else:  # autograd's own weight gradients too, once, for the coverage check
                losses.sum().backward(retain_graph=keep_graph)
            self._finish_pass()
            if not self._coverage_checked:
                self._check_coverage()
            self._drop_grads()
            norms = self._norms(losses)
            factors = factors_fn(norms)
            sums = self._book_kept_sums(factors) if self.passes == 1 else self._reweighted_sums(losses, factors)
        finally:
            self._reset()
        self.peak_bytes = max(self.peak_bytes, self.working_bytes)
        return sums

    def _finish_pass(self) -> None:
        for p in list(self._open):  # a call whose output did not reach the loss
            self._close(p)

    def _check_coverage(self) -> None:
        """Refuse a trainable parameter whose gradient has a part no hook saw (a parameter read
        outside its module's forward, e.g. by a parent module): no per-example norm would cover
        that part. Compares autograd's summed gradient with the sum of the hooks' pieces, once."""
        uncovered = []
        names = {p: n for n, p in self.model.named_parameters()}
        maps = {p: o for m, o in self.overrides.items() if hasattr(o, "map_gradient") for p in m.parameters()}
        grads = [p.grad for p in self.params if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self._summed.clear()
            return  # a non-finite example: compare on a later call
        # Rounding is measured against what was summed, not against the sum: a parameter whose
        # examples' gradients cancel (a LayerNorm weight under bf16: sum 20, Σ_i ‖G_i‖ 7000) is
        # compared at the tolerance times Σ_i ‖G_i‖, and one whose gradient is zero in exact
        # arithmetic (an attention key's bias: the softmax ignores it), rounding noise in both
        # sums, against the whole gradient at a thousandth of the tolerance.
        floor = 1e-3 * self.tolerance * float(torch.stack([g.float().norm() for g in grads]).norm()) if grads else 0.0
        for p in self.params:
            seen = self._summed.get(p)
            grad = p.grad
            if grad is None:
                continue
            grad = maps[p].map_gradient(p, grad.float()) if p in maps else grad.float()
            if seen is None:
                missing = grad.norm()
            else:
                missing = (grad - seen).norm() if seen.shape == grad.shape else torch.tensor(0.0)
            summed = self._norm_sq[p].sqrt().sum().item() if p in self._norm_sq else 0.0
            if missing.item() > self.tolerance * max(grad.norm().item(), summed) + floor + 1e-7:
                uncovered.append(names.get(p, "?"))
        self._summed.clear()
        self._coverage_checked = True
        if uncovered:
            mode = "bk" if self.passes == 1 else "ghost"
            raise UserError(
                f"algo.per_sample={mode}: the gradient of {', '.join(uncovered[:5])} is not (only) what its module's "
                "forward output received (the parameter is read outside that forward, or a view of the output "
                "is changed in place), so no per-example norm would cover it; use algo.per_sample=materialize "
                "or keep the parameter and the output inside the module"
            )

    def _norms(self, losses: torch.Tensor) -> torch.Tensor:
        """Each example's clip norm: the parameters' bounds summed in fp64, clamped at 0 (a guard:
        every bound is ≥ 0 when it holds), widened for that sum's rounding, rounded up to fp32."""
        norm_sq = torch.zeros(losses.shape[0], dtype=torch.float64, device=losses.device)
        for value in self._norm_sq.values():
            norm_sq = norm_sq + value.double()
        return _round_up_fp32((norm_sq.clamp(min=0) * _fp64_slack(len(self._norm_sq) + 4)).sqrt() * _fp64_slack(2))

    def _book_kept_sums(self, factors: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's clipped sum, its kept pieces released as soon as it is formed (the
        next layer's temporaries reuse their memory)."""
        # One host sync per step: when no clip factor is 0, no example's norm was non-finite, so
        # none of its pieces holds an inf or a NaN (either would make its norm non-finite) and the
        # sums skip zeroing dropped rows: a copy of every kept input and a pass over every output
        # gradient (about 6% of a ViT step on the CPU).
        all_finite = bool((factors > 0).all())
        # After the backward, a kept output gradient is read by the pieces that hold it and nothing
        # else: the last of them may scale it in place (one g can reach several layers, e.g. the
        # summed word and position embeddings, so pieces are counted by storage).
        readers = Counter(_storage(t) for piece in self._kept.values() for t in piece.tensors())
        sums = {}
        for p in list(self._kept):
            piece = self._kept.pop(p)
            own_g = isinstance(piece, OuterProduct) and readers[_storage(piece.g)] == 1
            with _exact_arithmetic(piece_device(piece)):
                sums[p] = piece.clipped_sum(factors, all_finite, own_g=own_g)
            readers.subtract(_storage(t) for t in piece.tensors())
        return [sums[p] if p in sums else torch.zeros(p.shape, device=p.device) for p in self.params]

    def _reweighted_sums(self, losses: torch.Tensor, factors: torch.Tensor) -> list[torch.Tensor]:
        """Ghost's second pass: the same backward again, every clipped piece summed in fp32 by the
        hooks as it arrives (one layer's working set at a time). Not autograd's reweighted
        backward (Opacus's ghost clipping): under autocast that sums Σ_i f_i g_i in bf16/fp16,
        whose rounding grows with the batch (one added example moved it by 2·C at batch 1024),
        and a non-finite example would poison it through 0 · inf."""
        self._factors = factors.detach().float()
        self._pending = dict(self._calls)
        self._activations = {m: list(reversed(kept)) for m, kept in self._replay.items()}
        self._replay = {}
        self._backward(losses.sum())
        self._finish_pass()
        self._drop_grads()
        return [self._summed.get(p, torch.zeros(p.shape, device=p.device)) for p in self.params]

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None  # the non-private batch gradient autograd also accumulated

    def _reset(self) -> None:
        self._drop_grads()
        self._activations.clear()
        self._replay.clear()
        self._pending.clear()
        self._open.clear()
        self._kept.clear()
        self._norm_sq.clear()
        self._summed.clear()
        self._factors = None
        self._entry_edges.clear()
        self._readers.clear()
        self._held.clear()

    def backward_per_sample(self, losses):
        raise UserError("this algorithm needs per-example gradients; use algo.per_sample=materialize")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _new_bytes(tensors: list[torch.Tensor], held: set[int]) -> int:
    """Bytes of the tensors whose storage is not yet in `held` (then added to it)."""
    new = 0
    for t in tensors:
        if _storage(t) not in held:
            held.add(_storage(t))
            new += t.numel() * t.element_size()
    return new


def piece_device(piece) -> torch.device:
    if isinstance(piece, TiedPieces):
        return piece.outer.g.device
    return (piece.grad_sample if isinstance(piece, Instantiated) else piece.g).device

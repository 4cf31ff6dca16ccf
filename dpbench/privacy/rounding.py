"""Rounding bounds of the clip norm (pieces.py's squared norms): unit roundoffs, Higham's γ_n, the
dtype a Gram is formed in, and the error of the dot products, quadratic forms and sums of squares
that a piece's norm is computed with. docs/privacy.md, "Rounding and the clip norm"."""

from __future__ import annotations

import contextlib
import math

import torch


# --- rounding bounds of the clip norm ------------------------------------------------------------
# Each piece's `norm_sq()` is N̂_i + E_i in fp64: the computed squared norm plus a bound E_i on
# |N̂_i − ‖G_i‖²| for the arithmetic that computed it, ‖G_i‖ the exact norm of the per-example
# gradient the kept tensors sum to; so it is ≥ ‖G_i‖² however an example's terms cancel (no clamp
# but on the total, BookKeeping._norms). Bounds are Higham's: an n-term dot product in unit
# roundoff u is off by at most γ_n Σ_k |x_k y_k| (γ_n = nu / (1 − nu)) in any summation order, with
# or without FMA.
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
    its E is about γ_width · T · ρ of ‖G‖² (ρ ≤ 1), so beyond γ_width(u₃₂) · T = 1e-2
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


def fp64_slack(ops: int) -> float:
    """Covers the fp64 rounding of a bound computed from nonnegative terms `ops` operations deep
    (relative γ_ops(2^-53), doubled)."""
    return 1.0 + 4.0 * ops * UNIT_ROUNDOFF[torch.float64]


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds, fp64, on the exact ‖x_t‖ of the last axis ([B, T, d] -> [B, T]): the computed
    sum of squares is at least (1 − γ_{d+3}) times the exact one, less d underflows."""
    dtype = _compute_dtype(x)
    computed = torch.linalg.vector_norm(x, dim=-1, dtype=dtype).double()
    d = x.shape[-1]
    return ((computed.pow(2) + (d + 2) * UNDERFLOW[dtype]) / (1.0 - _gamma(d + 3, UNIT_ROUNDOFF[dtype]))).sqrt() * fp64_slack(4)


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
    scale = fp64_slack(count + 4) / (1.0 - _gamma(last + 3, UNIT_ROUNDOFF[dtype]))
    return computed.add_(count * (last + 2) * UNDERFLOW[dtype]).mul_(scale)


def exact_arithmetic(device: torch.device):
    """Norms and sums in the dtypes the bounds assume, not autocast's."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def round_up_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp64 -> the nearest fp32 at or above."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def round_down_fp32(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return torch.where(y.double() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)

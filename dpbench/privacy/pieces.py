"""The piece forms of book-keeping and ghost clipping (bookkeeping.py): what is kept of one
parameter's per-example gradients G_i, each form's squared norm with a bound on its rounding, and
its clipped sum Σ_i f_i G_i. Which layer keeps which form: the layer catalogue, layers.py.

* `OuterProduct`: a Linear layer's G_i = g_iᵀ a_i from its input a [B, T, in] and output gradient
  g [B, T, out] (T = all middle positions). ‖G_i‖² = Σ_{t,s} (a_i a_iᵀ)_{ts} (g_i g_iᵀ)_{ts} (ghost
  norm, T² per example) when T² < in·out, else from the instantiated G_i; `compact` keeps (a, g)
  when T·(in+out) < in·out, else G_i, whichever is smaller (fastDP's "mixed" choice). Clipped sum:
  (f ⊙ g)ᵀ a over all B·T rows. A gradient map (DP-GRAPE) hands over (a, gP) or (aP, g), so the
  projected per-example gradient is never formed unless that is the smaller form.
* `EmbeddingRows`: token ids and g; ghost norm through equal-id pairs; clipped sum by index_add.
* `Instantiated`: per-example gradients [B, ...] (LayerNorm, biases, whatever a grad sampler forms).
* `TiedPieces`: a parameter read by layers of different kinds (an output layer tied to the input
  embedding): both parts kept, ‖Σ_k G_k‖² through their cross term.

A parameter used by several layer calls (tied or reused) has the norm of its summed per-example
gradient, not the parts' norms (`merge_pieces`): calls of one layer kind concatenate their tokens;
an output layer tied to the input embedding keeps both parts and adds their cross term; anything
else is instantiated and summed.

Per-example work runs over chunks of examples (`Piece.select`, `_in_chunks`): a norm's Grams and wide
copies (fp64 where the bound needs it) and a clipped sum's scaled copy of g would otherwise grow with
the batch, B times one example's, where ghost clipping is meant to hold one layer's working set; a
chunk's temporaries stay within `WORK_BYTES`. Each example's norm reads only its own rows, so chunks
change no norm; a clipped sum adds the chunks' sums (fp32, the order of the additions changes).

Every piece's squared norm is an upper bound that covers its own rounding (N̂_i + E_i, E_i bounding
|N̂_i − ‖G_i‖²| for the arithmetic used), because the Gram identities cancel when an example's
tokens do. docs/privacy.md, "Rounding and the clip norm".
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from dpbench.privacy.clipping import clipped_sum
from dpbench.privacy.rounding import (
    UNDERFLOW, UNIT_ROUNDOFF, _compute_dtype, _dot_error, _gamma, _gram_dtype, _products_sum, _quadratic, _row_norms,
    _sum_of_squares, fp64_slack,
)


class Piece(ABC):
    """What is kept of one parameter's per-example gradients G_i (B examples)."""

    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def examples(self) -> int:
        """B."""

    @abstractmethod
    def select(self, rows: slice) -> Piece:
        """The piece of the examples `rows` only (views, no copy)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def instantiate(self) -> torch.Tensor:
        """The per-example gradients [B, ...]."""

    @abstractmethod
    def compact(self, input_readers: int = 1) -> Piece:
        """The smaller of this form and the instantiated one."""

    @abstractmethod
    def norm_sq(self) -> torch.Tensor:
        """N̂_i + E_i per example, fp64 [B]: the computed ‖G_i‖² plus a bound on its rounding error,
        so ≥ the exact ‖G_i‖² of what `clipped_sum` sums (module doc)."""

    @abstractmethod
    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        """Σ_i f_i G_i in fp32."""


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


WORK_BYTES = 32 * 2**20  # per-example temporaries of one norm or clipped sum held at once (module doc)


def _example_chunks(examples: int, bytes_per_example: int) -> list[slice]:
    """Slices of the examples whose temporaries, at `bytes_per_example` each, fit in WORK_BYTES
    (at least one example a chunk)."""
    step = max(1, WORK_BYTES // max(1, bytes_per_example))
    return [slice(i, min(i + step, examples)) for i in range(0, max(examples, 1), step)]


def _in_chunks(piece: "Piece", bytes_per_example: int, per_example):
    """`per_example(chunk piece, its slice)` -> a [b] tensor or a tuple of them, over chunks of the
    examples, joined: the same values as one call on every example."""
    chunks = _example_chunks(piece.examples(), bytes_per_example)
    if len(chunks) == 1:
        return per_example(piece, chunks[0])
    parts = [per_example(piece.select(rows), rows) for rows in chunks]
    return tuple(torch.cat(column) for column in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)


def _summed_in_chunks(piece: "Piece", bytes_per_example: int, summed) -> torch.Tensor:
    """`summed(chunk piece, its slice)` -> a tensor, added up over chunks of the examples (fp32)."""
    chunks = _example_chunks(piece.examples(), bytes_per_example)
    if len(chunks) == 1:
        return summed(piece, chunks[0])
    total = None
    for rows in chunks:
        part = summed(piece.select(rows), rows)
        total = part if total is None else total.add_(part)
    return total


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


class Instantiated(Piece):
    """Per-example gradients [B, ...] of one parameter."""

    def __init__(self, grad_sample: torch.Tensor):
        self.grad_sample = grad_sample

    def nbytes(self) -> int:
        return _bytes(self.grad_sample)

    def examples(self) -> int:
        return self.grad_sample.shape[0]

    def select(self, rows: slice) -> Instantiated:
        return Instantiated(self.grad_sample[rows])

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
        def summed(piece: Instantiated, rows: slice) -> torch.Tensor:
            if not all_finite:  # zero the rows of dropped examples first (0 · inf)
                return clipped_sum([piece.grad_sample], factors[rows])[0]
            flat = piece.grad_sample.reshape(piece.grad_sample.shape[0], -1).float()
            return (factors[rows].float() @ flat).view(piece.grad_sample.shape[1:])

        return _summed_in_chunks(self, 4 * self.grad_sample[0].numel(), summed)  # an fp32 copy


class OuterProduct(Piece):
    """Per-example weight gradients G_i = g_iᵀ a_i [out, in] from a [B, T, in] and g [B, T, out]."""

    def __init__(self, activations: torch.Tensor, backprops: torch.Tensor):
        self.a, self.g = activations, backprops

    def nbytes(self) -> int:
        return _bytes(self.a, self.g)

    def examples(self) -> int:
        return self.a.shape[0]

    def select(self, rows: slice) -> OuterProduct:
        return OuterProduct(self.a[rows], self.g[rows])

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
        if tokens * tokens >= d_in * d_out:  # G_i in fp32 (fp64 for a float64 model), and its squares
            return _in_chunks(self, 16 * d_in * d_out, lambda piece, _: _instantiated_norm_sq(piece.a, piece.g))
        # fp64 copies of a and g (where `_gram_dtype` says), two Grams and their products and magnitudes
        return _in_chunks(self, 8 * tokens * (d_in + d_out) + 48 * tokens * tokens,
                          lambda piece, _: _gram_norm_sq(piece.a, piece.g))

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        """Σ_i f_i G_i = (f ⊙ g)ᵀ a = gᵀ (f ⊙ a). Rows of dropped examples (f_i = 0: a non-finite
        gradient) are zeroed in a and g, unless `all_finite` says no f_i is 0 (then every row is
        finite). The factors scale g in place when `own_g` says nothing else reads it (book-keeping
        after its backward: no copy, no new memory), else a copy of the narrower of a and g."""
        def summed(piece: OuterProduct, rows: slice) -> torch.Tensor:
            f = factors[rows]

            def unscaled(x):
                return x.float() if all_finite else _keep_rows(x.float(), f > 0)

            if own_g and piece.g.dtype == torch.float32 and piece.g.is_contiguous():
                a, g = unscaled(piece.a), _scaled_rows(piece.g, f, all_finite, in_place=True)
            elif piece.a.shape[2] < piece.g.shape[2]:
                a, g = _scaled_rows(piece.a, f, all_finite), unscaled(piece.g)
            else:
                a, g = unscaled(piece.a), _scaled_rows(piece.g, f, all_finite)
            return g.reshape(-1, g.shape[2]).transpose(0, 1) @ a.reshape(-1, a.shape[2])  # [out, in]

        return _summed_in_chunks(self, 4 * self.a.shape[1] * (self.a.shape[2] + self.g.shape[2]), summed)  # fp32 copies

    def merge(self, other: OuterProduct) -> OuterProduct:
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
    return estimate, error * fp64_slack(area + 16), spread * fp64_slack(tokens + 4)


def _instantiated_norm_sq(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖G_i‖² from G_i instantiated in fp32 (fp64 for a float64 model): ‖Ĝ_i − G_i‖ ≤ e_T S (+ underflow),
    so ‖G_i‖² ≤ (√U(Ĝ) + e_T S)², returned as (N̂, that bound − N̂, S)."""
    dtype, tokens = _compute_dtype(a, g), a.shape[1]
    instantiated = torch.einsum("bto,bti->boi", g.to(dtype), a.to(dtype))
    estimate = torch.linalg.vector_norm(instantiated.flatten(1), dim=1, dtype=torch.float64).pow(2)
    spread = (_row_norms(a) * _row_norms(g)).sum(dim=1) * fp64_slack(tokens + 4)
    entries = instantiated[0].numel()
    off = _dot_error(tokens, dtype) * spread + 2 * tokens * UNDERFLOW[dtype] * math.sqrt(entries)
    bound = ((_sum_of_squares(instantiated).sqrt() + off).pow(2)) * fp64_slack(4)
    return estimate, bound - estimate, spread


class EmbeddingRows(Piece):
    """Per-example gradients of an embedding table [V, d] from token ids [B, T] and g [B, T, d]."""

    def __init__(self, ids: torch.Tensor, backprops: torch.Tensor, num_embeddings: int):
        self.ids, self.g, self.num_embeddings = ids, backprops, num_embeddings

    def nbytes(self) -> int:
        return _bytes(self.ids, self.g)

    def examples(self) -> int:
        return self.g.shape[0]

    def select(self, rows: slice) -> EmbeddingRows:
        return EmbeddingRows(self.ids[rows], self.g[rows], self.num_embeddings)

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
        return _in_chunks(self, 8 * tokens * dim + 40 * tokens * tokens, lambda piece, _: piece._bounds())

    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        return estimate, error * fp64_slack(area + 8), spread

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        table = torch.zeros((self.num_embeddings, self.g.shape[2]), dtype=torch.float32, device=self.g.device)
        for rows in _example_chunks(self.examples(), 4 * self.g.shape[1] * self.g.shape[2]):  # a scaled copy of g
            g = _scaled_rows(self.g[rows], factors[rows], all_finite)
            table.index_add_(0, self.ids[rows].reshape(-1), g.reshape(-1, g.shape[2]))
        return table

    def merge(self, other: EmbeddingRows) -> EmbeddingRows:
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
    total = magnitude.sum(dim=(1, 2), dtype=torch.float64) * fp64_slack(tokens * others)
    e, t = _dot_error(dim, dtype), 2 * dim * UNDERFLOW[dtype]
    error = e * weighted + t * total + rounding * ((1 + e) * weighted + t * total) + underflow
    return cross, error * fp64_slack(16)


class TiedPieces(Piece):
    """One parameter read by layers of different kinds (a language model's output layer tied to
    its input embedding): the parts kept apart, ‖Σ_k G_k‖² = Σ_k ‖G_k‖² + 2 Σ_{j<k} ⟨G_j, G_k⟩
    with the cross terms in ghost form, so no per-example table is formed unless it is smaller."""

    def __init__(self, outer: OuterProduct, rows: EmbeddingRows):
        self.outer, self.rows = outer, rows

    def nbytes(self) -> int:
        return self.outer.nbytes() + self.rows.nbytes()

    def examples(self) -> int:
        return self.outer.examples()

    def select(self, rows: slice) -> TiedPieces:
        return TiedPieces(self.outer.select(rows), self.rows.select(rows))

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
        tokens, others, dim = self.outer.g.shape[1], self.rows.g.shape[1], self.outer.a.shape[2]
        cross, cross_error = _in_chunks(self, 8 * (tokens + others) * dim + 40 * tokens * others,
                                        lambda piece, _: _outer_embedding_cross(piece.outer, piece.rows))
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


def merge_pieces(first, second) -> Piece:
    """One parameter's pieces from two layer calls, as the piece of their summed gradient."""
    if (type(first) is type(second) or isinstance(first, TiedPieces)) and hasattr(first, "merge"):
        try:
            return first.merge(second)
        except RuntimeError:  # shapes that do not concatenate: fall through to instantiation
            pass
    tied = _tie(first, second)
    if tied is not None:
        return tied
    return Instantiated(first.instantiate() + second.instantiate())


def piece_device(piece: Piece) -> torch.device:
    if isinstance(piece, TiedPieces):
        return piece.outer.g.device
    return (piece.grad_sample if isinstance(piece, Instantiated) else piece.g).device

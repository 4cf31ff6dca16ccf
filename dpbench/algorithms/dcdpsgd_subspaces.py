"""DC-DPSGD's public random subspaces (dcdpsgd.py): a fresh orthonormal basis of the span of
i.i.d. sub-Weibull vectors each step, dense or in blocks when it would not fit, and each example's
score, the share of its identification gradient's energy inside the subspace. Public: drawn from
the algorithm's own generator, never from the data."""

from __future__ import annotations

import torch

MAX_PROJECTION_ELEMENTS = 50_000_000  # d_id * k floats generated at once: beyond, A is drawn in blocks of rows
# d_id * k floats a blocked draw may hold for its step (4 GB in fp32): each block is then generated
# once a step, not again for every physical chunk; beyond, blocks are regenerated per projection
MAX_HELD_ELEMENTS = 1_000_000_000

class SubWeibullSubspaces:
    """Draws a fresh [dim, k] orthonormal basis of the span of i.i.d. symmetric sub-Weibull(theta)
    vectors at every call, on `device`, into buffers allocated once.

    The paper names no generator: we use a Weibull with shape 1/theta (tail
    P(|X|>t) = exp(-t^(1/theta)), i.e. sub-Weibull with index theta) with random signs, so the
    entries are centred; inverse-CDF sampling keeps the public generator explicit.
    Why buffers: fresh d x k tensors every step (tens of MB) are below glibc's adaptive mmap
    threshold once one has been freed, so they come from the heap and fragment it, and the CPU
    peak grows with the step count.
    The basis returned is overwritten by the next call. Above `max_elements`, `draw` returns a
    `BlockBasis` instead (the same draw, generated in blocks of rows): held whole for the step up
    to `max_held_elements` (`held`), else never held whole.
    """

    def __init__(self, dim: int, k: int, theta: float, generator: torch.Generator, device=None,
                 max_elements: int = MAX_PROJECTION_ELEMENTS, max_held_elements: int = MAX_HELD_ELEMENTS):
        k = min(k, dim)
        self.dim, self.k, self.theta, self.generator = dim, k, theta, generator
        self.device = torch.device(device) if device is not None else generator.device
        self.block_rows = dim if dim * k <= max_elements else max(1, max_elements // k)
        self.held = self.blocks > 1 and dim * k <= max_held_elements
        self.basis = torch.empty((dim if self.held else self.block_rows, k), device=self.device)
        self.signs = torch.empty((self.block_rows, k), device=self.device)  # scratch of one block

    @property
    def blocks(self) -> int:
        return -(-self.dim // self.block_rows)

    def sub_weibull(self, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Fills `out` with i.i.d. symmetric sub-Weibull(theta) entries.

        One uniform U per entry gives both the sign and the magnitude's uniform |2U - 1|, which are
        independent: one generator call, not two (randint was a fifth of a tanh-CNN step). Six
        passes over `out` (the generation is most of a blocked subspace's cost)."""
        uniform = torch.rand(out.shape, generator=generator, out=out, device=self.device)
        centred = torch.add(torch.tensor(-1.0, device=self.device), uniform, alpha=2, out=out)  # 2U - 1: exact in fp32
        magnitude = torch.abs(centred, out=self.signs[: out.shape[0]]).clamp_min_(1e-12).log_()  # |2U - 1| is uniform on [0, 1]
        magnitude.square_() if self.theta == 2 else magnitude.neg_().pow_(self.theta)  # (-log|2U - 1|)^theta
        return torch.copysign(magnitude, centred, out=out)  # the sign of 2U - 1

    def draw(self) -> "DenseBasis | BlockBasis":
        if self.blocks == 1:
            return DenseBasis(self.sub_weibull(self.basis, self.generator))
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device).item())
        return BlockBasis(self, seed)

    def block(self, seed: int, index: int) -> torch.Tensor:
        """Rows [index * block_rows, ...) of the raw draw A of `seed` (regenerated bit for bit),
        written into those rows of the held draw when `held`."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed + index * 1_000_003) % 2**63)
        start = index * self.block_rows if self.held else 0
        rows = min(self.block_rows, self.dim - index * self.block_rows)
        return self.sub_weibull(self.basis[start : start + rows], generator)


def whitening(gram: torch.Tensor) -> torch.Tensor:
    """W = Q Lambda^-1/2 [k, rank] (fp64) for the Gram A^T A = Q Lambda Q^T, so that V = A W has
    V^T V = I and spans span(A); directions with a negligible eigenvalue are dropped, so V stays
    orthonormal even for a rank-deficient draw."""
    eigenvalues, vectors = torch.linalg.eigh(gram.double())
    kept = eigenvalues > eigenvalues.max() * gram.shape[0] * torch.finfo(torch.float32).eps
    return vectors[:, kept] / eigenvalues[kept].sqrt()


Rows = "torch.Tensor | list[torch.Tensor]"  # [b, d], or its column pieces [b, d_j] in order (no concatenated copy)


def pieces_of(rows) -> list[torch.Tensor]:
    return list(rows) if isinstance(rows, (list, tuple)) else [rows]


def raw_coordinates(rows, row_blocks, k: int) -> torch.Tensor:
    """[b, k] fp64: A^T x of each row x, for A given as (first row, block) pieces in order; each
    overlap of a block and a piece of `rows` is one fp32 product, accumulated in fp64."""
    pieces = pieces_of(rows)
    out = torch.zeros((pieces[0].shape[0], k), dtype=torch.float64, device=pieces[0].device)
    for start, block in row_blocks:
        end, offset = start + block.shape[0], 0
        for piece in pieces:
            low, high = max(start, offset), min(end, offset + piece.shape[1])
            if low < high:
                out += (piece[:, low - offset : high - offset] @ block[low - start : high - start].to(piece.dtype)).double()
            offset += piece.shape[1]
    return out


class DenseBasis:
    """V = A W for a d x k draw A held whole (see `whitening`).

    Why not orthonormalise A itself: scores need only V^T u = W^T (A^T u), so one Gram (d k^2)
    and a k x k eigendecomposition replace CholeskyQR2's two Grams and two d x k triangular solves
    (~2.5x fewer flops; the basis was most of a tanh-CNN step). A is the subspaces' buffer:
    overwritten by the next draw."""

    def __init__(self, raw: torch.Tensor):
        self.raw = raw
        self.whitening = whitening(raw.T @ raw)

    def project(self, rows: Rows) -> torch.Tensor:
        """[b, d] (or its pieces) -> [b, rank]: the coordinates V^T x of each row x in the orthonormal basis V."""
        return raw_coordinates(rows, [(0, self.raw)], self.raw.shape[1]) @ self.whitening

    def dense(self) -> torch.Tensor:
        """V as one [d, rank] tensor (tests)."""
        return (self.raw.double() @ self.whitening).float()


class BlockBasis:
    """V = A W (see `whitening`) for a d x k draw A generated in row blocks from a per-step seed.

    The first projection generates each block once and accumulates the Gram A^T A in the same
    pass (A^T x does not need W). Then, when the subspaces hold A (`held`), later projections
    read it back; otherwise they regenerate the blocks (the working set is one block)."""

    def __init__(self, subspaces: SubWeibullSubspaces, seed: int):
        self.subspaces, self.seed = subspaces, seed
        self.whitening: torch.Tensor | None = None  # [k, rank] fp64, once the first pass has run

    def row_blocks(self):
        """(first row, block) of A in order; on the first pass, the Gram and W from them."""
        subspaces = self.subspaces
        if self.whitening is not None and subspaces.held:
            yield 0, subspaces.basis
            return
        gram = None if self.whitening is not None else \
            torch.zeros((subspaces.k, subspaces.k), dtype=torch.float64, device=subspaces.device)
        for index in range(subspaces.blocks):
            block = subspaces.block(self.seed, index)
            if gram is not None:
                gram += (block.T @ block).double()
            yield index * subspaces.block_rows, block
        if gram is not None:
            self.whitening = whitening(gram)

    def project(self, rows: Rows) -> torch.Tensor:
        """[b, d] (or its pieces) -> [b, rank]: the coordinates V^T x of each row x in the orthonormal basis V."""
        raw = raw_coordinates(rows, self.row_blocks(), self.subspaces.k)
        return raw @ self.whitening

    def dense(self) -> torch.Tensor:
        """V as one [d, rank] tensor (tests)."""
        return self.project(torch.eye(self.subspaces.dim, device=self.subspaces.device)).float()


def subspace_scores(identification_grads: Rows, basis: "torch.Tensor | DenseBasis | BlockBasis | None") -> torch.Tensor:
    """lambda_i = ||V^T g_i/||g_i||||^2 for [B, d_id] gradients (or their column pieces [B, d_j]):
    in [0, 1] (sensitivity 1).

    A zero gradient scores 0. The clamp only absorbs rounding: with V^T V = I the value is
    already at most 1, and clamping makes the bound hold whatever V is. `basis=None` is the
    paper's "k = None" (no subspace identification; V = I): every non-zero gradient scores 1.
    """
    pieces = pieces_of(identification_grads)
    norms = torch.linalg.vector_norm(torch.stack([p.norm(dim=1) for p in pieces]), dim=0)
    if basis is None:
        return (norms > 0).float()
    # ||V^T g||^2 / ||g||^2: the same as scoring g/||g||, without materialising the unit rows
    # (three [B, d] temporaries were a third of the scoring time); 0/0 and overflow score 0
    projected = basis.project(pieces) if isinstance(basis, (DenseBasis, BlockBasis)) \
        else raw_coordinates(pieces, [(0, basis)], basis.shape[1])
    energy = projected.double().pow(2).sum(dim=1) / norms.double().pow(2)
    return torch.nan_to_num(energy, nan=0.0, posinf=0.0, neginf=0.0).clamp(0.0, 1.0).to(pieces[0].dtype)

"""DC-DPSGD's public random subspaces (dcdpsgd.py): a fresh orthonormal basis of the span of
i.i.d. sub-Weibull vectors each step, dense or in blocks when it would not fit, and each example's
score, the share of its identification gradient's energy inside the subspace. Public: drawn from
the algorithm's own generator, never from the data."""

from __future__ import annotations

import torch

MAX_PROJECTION_ELEMENTS = 50_000_000  # d_id * k floats held at once: beyond, V is built in blocks

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
    `BlockBasis` instead (the same kind of subspace, never held whole).
    """

    def __init__(self, dim: int, k: int, theta: float, generator: torch.Generator, device=None,
                 max_elements: int = MAX_PROJECTION_ELEMENTS):
        k = min(k, dim)
        self.dim, self.k, self.theta, self.generator = dim, k, theta, generator
        self.device = torch.device(device) if device is not None else generator.device
        self.block_rows = dim if dim * k <= max_elements else max(1, max_elements // k)
        rows = self.block_rows
        self.basis, self.signs = (torch.empty((rows, k), device=self.device) for _ in range(2))  # signs: scratch

    @property
    def blocks(self) -> int:
        return -(-self.dim // self.block_rows)

    def sub_weibull(self, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Fills `out` with i.i.d. symmetric sub-Weibull(theta) entries.

        One uniform U per entry gives both the sign (U < 1/2) and the magnitude's uniform
        |2U - 1|, which are independent: one generator call, not two (randint was a fifth of a
        tanh-CNN step)."""
        centred = torch.rand(out.shape, generator=generator, out=out, device=self.device).sub_(0.5)
        magnitude = torch.abs(centred, out=self.signs[: out.shape[0]])  # |U - 1/2|: uniform on [0, 1/2]
        magnitude.mul_(2).clamp_min_(1e-12).log_().neg_().pow_(self.theta)
        return torch.copysign(magnitude, centred, out=out)  # the sign of U - 1/2

    def draw(self) -> "DenseBasis | BlockBasis":
        if self.blocks == 1:
            return DenseBasis(self.sub_weibull(self.basis, self.generator))
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device).item())
        return BlockBasis(self, seed)

    def block(self, seed: int, index: int) -> torch.Tensor:
        """Rows [index * block_rows, ...) of the raw draw A of `seed` (regenerated bit for bit)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed + index * 1_000_003) % 2**63)
        rows = min(self.block_rows, self.dim - index * self.block_rows)
        return self.sub_weibull(self.basis[:rows], generator)


def whitening(gram: torch.Tensor) -> torch.Tensor:
    """W = Q Lambda^-1/2 [k, rank] (fp64) for the Gram A^T A = Q Lambda Q^T, so that V = A W has
    V^T V = I and spans span(A); directions with a negligible eigenvalue are dropped, so V stays
    orthonormal even for a rank-deficient draw."""
    eigenvalues, vectors = torch.linalg.eigh(gram.double())
    kept = eigenvalues > eigenvalues.max() * gram.shape[0] * torch.finfo(torch.float32).eps
    return vectors[:, kept] / eigenvalues[kept].sqrt()


class DenseBasis:
    """V = A W for a d x k draw A held whole (see `whitening`).

    Why not orthonormalise A itself: scores need only V^T u = W^T (A^T u), so one Gram (d k^2)
    and a k x k eigendecomposition replace CholeskyQR2's two Grams and two d x k triangular solves
    (~2.5x fewer flops; the basis was most of a tanh-CNN step). A is the subspaces' buffer:
    overwritten by the next draw."""

    def __init__(self, raw: torch.Tensor):
        self.raw = raw
        self.whitening = whitening(raw.T @ raw)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """[b, d] -> [b, rank]: the coordinates V^T x of each row x in the orthonormal basis V."""
        return (rows @ self.raw.to(rows.dtype)).double() @ self.whitening

    def dense(self) -> torch.Tensor:
        """V as one [d, rank] tensor (tests)."""
        return (self.raw.double() @ self.whitening).float()


class BlockBasis:
    """V = A W (see `whitening`) for a d x k draw A regenerated in row blocks."""

    def __init__(self, subspaces: SubWeibullSubspaces, seed: int):
        self.subspaces, self.seed = subspaces, seed
        gram = torch.zeros((subspaces.k, subspaces.k), dtype=torch.float64, device=subspaces.device)
        for index in range(subspaces.blocks):
            block = subspaces.block(seed, index)
            gram += (block.T @ block).double()
        self.whitening = whitening(gram)  # [k, rank] fp64

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """[b, d] -> [b, rank]: the coordinates V^T x of each row x in the orthonormal basis V."""
        subspaces, start = self.subspaces, 0
        raw = torch.zeros((rows.shape[0], subspaces.k), dtype=torch.float64, device=rows.device)
        for index in range(subspaces.blocks):
            block = subspaces.block(self.seed, index)
            raw += (rows[:, start : start + block.shape[0]] @ block.to(rows.dtype)).double()
            start += block.shape[0]
        return raw @ self.whitening

    def dense(self) -> torch.Tensor:
        """V as one [d, rank] tensor (tests)."""
        return self.project(torch.eye(self.subspaces.dim, device=self.subspaces.device)).float()


def subspace_scores(identification_grads: torch.Tensor, basis: "torch.Tensor | DenseBasis | BlockBasis | None") -> torch.Tensor:
    """lambda_i = ||V^T g_i/||g_i||||^2 for [B, d_id] gradients: in [0, 1] (sensitivity 1).

    A zero gradient scores 0. The clamp only absorbs rounding: with V^T V = I the value is
    already at most 1, and clamping makes the bound hold whatever V is. `basis=None` is the
    paper's "k = None" (no subspace identification; V = I): every non-zero gradient scores 1.
    """
    norms = identification_grads.norm(dim=1)
    if basis is None:
        return (norms > 0).float()
    # ||V^T g||^2 / ||g||^2: the same as scoring g/||g||, without materialising the unit rows
    # (three [B, d] temporaries were a third of the scoring time); 0/0 and overflow score 0
    projected = basis.project(identification_grads) if isinstance(basis, (DenseBasis, BlockBasis)) \
        else identification_grads @ basis.to(identification_grads.dtype)
    energy = projected.double().pow(2).sum(dim=1) / norms.double().pow(2)
    return torch.nan_to_num(energy, nan=0.0, posinf=0.0, neginf=0.0).clamp(0.0, 1.0).to(identification_grads.dtype)

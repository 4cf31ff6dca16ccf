"""Shared pieces of DP-GRAPE, naive DP-GaLore and GaLore: which layers are projected, on which
side, and Adam with moments in the projected space.

Not an algorithm itself (nothing is registered here). Conventions, for a weight W of shape
(m, n) = (out, in) and rank r (paper Sec. 2, projection on the smaller side as in GaLore):

* side "left"  (m <= n): P is (m, r), R = Pᵀ G is (r, n), back-projection P N.
* side "right" (m >  n): P is (n, r), R = G P is (m, r), back-projection N Pᵀ.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn

from dpbench.algorithms.learning_rates import lr_scale
from dpbench.runtime import sharding
from dpbench.algorithms.base import adam_betas
from dpbench.errors import UserError
from dpbench.models import default_projected_modules
from dpbench.options import AlgoOptions


@dataclass
class ProjectedAdamOptions(AlgoOptions):
    """GaLore's options (`algo=galore`), and the base of naive DP-GaLore's and DP-GRAPE's: Adam in
    rank-r subspaces refreshed every F steps."""

    name: str = "galore"
    rank: int = 16
    update_interval: int = 20
    betas: List[float] = field(default_factory=adam_betas)
    eps: float = 1.0e-8
    weight_decay: float = 0.0
    projected_modules: Optional[List[str]] = None


@dataclass(frozen=True)
class Projection:
    """How one 2-D weight is projected. `index` numbers projected layers (per-layer seeds)."""

    index: int
    name: str
    side: str  # "left" | "right"
    rank: int
    projected_dim: int  # m for left, n for right: the rows of P
    kept_dim: int  # the other dimension (n_ℓ in the paper's Table 2)

    @property
    def projected_shape(self) -> torch.Size:
        return torch.Size((self.rank, self.kept_dim) if self.side == "left" else (self.kept_dim, self.rank))


def make_projection(index: int, name: str, shape: torch.Size, rank: int) -> Projection:
    m, n = shape
    side = "left" if m <= n else "right"
    small, large = min(m, n), max(m, n)
    # r larger than the projected side would only add coordinates (and noise); clamp it.
    return Projection(index, name, side, min(int(rank), small), small, large)


def select_projected_modules(model: nn.Module, patterns) -> dict[str, nn.Linear]:
    """Trainable nn.Linear modules whose name matches one of the fnmatch `patterns` (None: the
    model family's `projected_modules`, see dpbench/models)."""
    patterns = list(default_projected_modules(model) if patterns is None else patterns)
    chosen = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not module.weight.requires_grad:
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            chosen[name] = module
    weights = [m.weight for m in chosen.values()]
    if len({id(w) for w in weights}) != len(weights):
        raise UserError("two projected modules share one weight; exclude one of them from algo.projected_modules")
    return chosen


def check_not_tied_outside(model: nn.Module, projected: dict[str, nn.Linear]) -> None:
    """A projected weight used by another (non-projected) module would get full-shape per-sample
    gradients from that module's hook, which cannot be added to projected ones."""
    projected_ids = {id(m.weight): name for name, m in projected.items()}
    projected_modules = set(map(id, projected.values()))
    for name, module in model.named_modules():
        if id(module) in projected_modules:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in projected_ids:
                raise UserError(
                    f"weight of projected layer {projected_ids[id(p)]} is tied to {name}; "
                    "exclude it from algo.projected_modules"
                )


def project(gradient: torch.Tensor, projector: torch.Tensor, side: str) -> torch.Tensor:
    """(m, n) -> Pᵀ G (r, n) or G P (m, r); works on a leading batch dimension too."""
    if side == "left":
        return projector.transpose(0, 1) @ gradient
    return gradient @ projector


def back_project(low: torch.Tensor, projector: torch.Tensor, side: str, rows: slice | None = None) -> torch.Tensor:
    """(r, n) -> P N (m, n) or (m, r) -> N Pᵀ (m, n); with `rows`, only those rows of it (a
    sharded weight's: P[rows] N or N[rows] Pᵀ, never the whole (m, n))."""
    if side == "left":
        return (projector if rows is None else projector[rows]) @ low
    return (low if rows is None else low[rows]) @ projector.transpose(0, 1)


def adam_config(cfg) -> dict:
    betas, eps, weight_decay = tuple(cfg.betas), cfg.eps, cfg.weight_decay
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise UserError(f"algo.betas must be two numbers in [0, 1), got {list(betas)}")
    if eps <= 0 or weight_decay < 0:
        raise UserError(f"algo.eps must be > 0 and algo.weight_decay >= 0, got {eps}, {weight_decay}")
    return dict(betas=betas, eps=eps, weight_decay=weight_decay)


class ProjectedAdam:
    """Adam whose moments live in the projected space for projected weights (paper Algorithm 2)
    and in full space for every other parameter (Algorithm 3).

    Hand-written because torch.optim.Adam keeps moments in the parameter's own shape; here the
    update direction M̂/(√V̂+φ) is computed in (r × n) and back-projected. The arithmetic follows
    torch.optim.Adam (bias corrections 1−β1ᵗ, √(1−β2ᵗ), φ added after the corrected root), so an
    identity projector reproduces torch.optim.Adam exactly. Weight decay is decoupled (AdamW, as
    in GaLore and the DP-GRAPE reference code's DPAdamW), applied to the full weight. Moments are
    kept across subspace changes, as in GaLore and the reference code (the paper is silent).

    A sharded parameter (train.sharding=fsdp, a DTensor holding this rank's rows): its gradient
    and moments are whole (DP-GRAPE releases them replicated, identical on every rank), and only
    this rank's rows of the update (P[rows] N, N[rows] Pᵀ, or the rows of a full-space direction)
    are applied to its local shard.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, betas, eps: float, weight_decay: float):
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.step_count = 0
        self.state: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, gradients: list[torch.Tensor], projectors: dict[nn.Parameter, tuple[torch.Tensor, str]]) -> None:
        """`gradients[i]` is in the projected shape when `params[i]` has an entry (P, side)."""
        self.step_count += 1
        beta1, beta2 = self.betas
        correction1 = 1 - beta1**self.step_count
        correction2_sqrt = math.sqrt(1 - beta2**self.step_count)
        for p, g in zip(self.params, gradients):
            g = g.float()
            if p not in self.state:
                self.state[p] = (torch.zeros_like(g), torch.zeros_like(g))
            exp_avg, exp_avg_sq = self.state[p]
            exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            direction = exp_avg / (exp_avg_sq.sqrt() / correction2_sqrt + self.eps)  # (r, n) or full
            target, rows = sharding.local(p), None
            if target is not p:  # a sharded parameter (train.sharding=fsdp): this rank's rows of the update
                rows = sharding.local_rows(p)
            if p in projectors:
                projector, side = projectors[p]
                direction = back_project(direction, projector.to(direction.dtype), side, rows)  # (m, n) or its rows
            elif rows is not None:
                direction = direction[rows]
            lr = self.lr * lr_scale(p)  # train.head_lr_scale (learning_rates.py)
            if self.weight_decay:
                target.mul_(1 - lr * self.weight_decay)
            target.add_(direction.to(target.dtype), alpha=-lr / correction1)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.state.values() for t in pair)


def projection_summary(projections: dict[nn.Parameter, Projection], params: list[nn.Parameter]) -> dict:
    """Counts behind the paper's Table 2, for results.json."""
    projected_ids = {id(p) for p in projections}
    return {
        "projected_layers": [proj.name for proj in projections.values()],
        "ranks": sorted({proj.rank for proj in projections.values()}),
        "projected_weight_numel": sum(p.numel() for p in projections),
        "projected_numel": sum(proj.rank * proj.kept_dim for proj in projections.values()),  # r Σ n_ℓ
        "full_numel": sum(p.numel() for p in params if id(p) not in projected_ids),
    }


class SVDSubspaces:
    """GaLore's projectors (Algorithms 4-5): every F steps, P = top-r singular vectors of the
    current batch gradient of each projected layer (U[:, :r] for side left, V[:, :r] for right),
    stored until the next refresh (Table 2: r Σ m_ℓ projector memory)."""

    def __init__(self, projections: dict[nn.Parameter, Projection], update_interval: int):
        self.projections = projections
        self.update_interval = update_interval
        self.projectors: dict[nn.Parameter, torch.Tensor] = {}

    @torch.no_grad()
    def projected_step(self, adam: ProjectedAdam, params: list[nn.Parameter], gradients: list[torch.Tensor]) -> None:
        """Refresh P when due (step 0, F, 2F, ...), project full-shape gradients, Adam-step."""
        refresh = adam.step_count % self.update_interval == 0
        low, projectors = [], {}
        for p, g in zip(params, gradients):
            projection = self.projections.get(p)
            if projection is None:
                low.append(g)
                continue
            if refresh or p not in self.projectors:
                self.projectors[p] = self._svd_projector(g, projection)
            projector = self.projectors[p]
            low.append(project(g.float(), projector, projection.side))
            projectors[p] = (projector, projection.side)
        adam.step(low, projectors)

    @staticmethod
    def _svd_projector(gradient: torch.Tensor, projection: Projection) -> torch.Tensor:
        # A non-finite gradient makes the SVD fail to converge (GaLore issues #26/#58).
        g = torch.nan_to_num(gradient.float(), nan=0.0, posinf=0.0, neginf=0.0)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        if projection.side == "left":
            return u[:, : projection.rank].contiguous()  # (m, r)
        return vh[: projection.rank].transpose(0, 1).contiguous()  # (n, r)

    def projector_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.projectors.values())

    def summary(self, params: list[nn.Parameter], rank: int) -> dict:
        """What results.json records about the subspaces (galore and galore_naive alike)."""
        return {
            **projection_summary(self.projections, params),
            "rank": rank,
            "update_interval": self.update_interval,
            "projector_bytes": self.projector_bytes(),
        }


def build_projections(model: nn.Module, cfg) -> tuple[dict[str, nn.Linear], dict[nn.Parameter, Projection]]:
    """The projected modules by name, and each one's weight -> Projection (algo.rank, patterns)."""
    rank, interval = cfg.rank, cfg.update_interval
    if rank < 1 or interval < 1:
        raise UserError(f"algo.rank and algo.update_interval must be >= 1, got {cfg.rank}, {cfg.update_interval}")
    modules = select_projected_modules(model, cfg.projected_modules)
    check_not_tied_outside(model, modules)
    return modules, {
        module.weight: make_projection(i, name, module.weight.shape, rank)
        for i, (name, module) in enumerate(modules.items())
    }

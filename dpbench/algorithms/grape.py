"""DP-GRAPE (Mulrooney et al. 2025, Algorithms 1-2): DP-Adam on per-sample gradients that are
randomly projected inside the backward hook.

For every projected nn.Linear (default: the Linear layers of the transformer blocks) the hook
computes the projected per-sample gradient straight from the layer's input x and output gradient
δ, without ever forming the full per-sample gradient G_i = Σ_t δ_tᵀ x_t (the reference code forms
it one layer at a time; this never does):

    side "left"  (out <= in): R_i = Pᵀ G_i = Σ_t (δ_t P)ᵀ x_t   -> [B, r, in]
    side "right" (out >  in): R_i = G_i P  = Σ_t δ_tᵀ (x_t P)   -> [B, out, r]

Everything else (embeddings, patch embedding, head, norms, biases, class/position tokens) keeps
full per-sample gradients. With `algo.per_sample=bk` or `ghost` (dpbench.privacy.bookkeeping)
the same projected gradients are clipped without forming them: norms from (x xᵀ) and
((δP)(δP)ᵀ) (or the smaller instantiated form), then the clipped sum in one matmul (book-keeping)
or from a reweighted second backward, projected (ghost). Projection, clipping and noise are as
below in every mode. The concatenation of all of them is flat-clipped to C, summed, noised
with N(0, σ²C²) per coordinate in the projected space and divided by the expected batch size
(V-arXiv Algorithm 1; the V-conf rendering that adds the noise after the division is wrong).
One Gaussian mechanism per step, exactly as DP-Adam: the projectors are public randomness,
independent of the data.

Projectors have i.i.d. N(0, 1/r) entries as the paper states, so E[P Pᵀ] = I and the
back-projection is unbiased (the authors' code draws them with std 1/r instead, i.e. variance
1/r², which only rescales the effective learning rate by 1/r). They are generated on the fly from
a per-layer seed with a dedicated torch.Generator, never stored, regenerated bit-identically for
the back-projection, and re-seeded every `update_interval` steps: steps [kF, (k+1)F) share window
k's seeds. Seeds derive from `projection_seed` (default: drawn from the experiment-seeded global
RNG at start). The privacy noise never touches these generators; it comes from PrivacySetup.noise.

Sharded (train.sharding=fsdp, bk or ghost): the hooks see FSDP2's all-gathered weight and this
rank's own activations and output gradients, so each rank forms its examples' projected clipped
sums as one process does. The release is REPLICATED (the projected sums are small): summed over
the ranks, one noise draw on rank 0, broadcast, so every rank holds the same noisy release,
regenerates the same P from the shared seed (checked against rank 0's at start) and keeps the
same projected moments; each applies only its own rows of the full-space update P·U to its
shard. The parameters that are not projected (biases, norms, embeddings, head) go in the same
release (one mechanism, one draw), whole on every rank: their moments are not sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from dpbench.runtime import distributed
from dpbench.algorithms.base import ALGORITHMS, StepResult
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample
from dpbench.algorithms.projected_adam import (
    ProjectedAdam,
    ProjectedAdamOptions,
    Projection,
    adam_config,
    build_projections,
    project,
    projection_summary,
)
from dpbench.options import choice_of
from dpbench.privacy.release import REPLICATED


def gaussian_projector(rows: int, rank: int, generator: torch.Generator, device) -> torch.Tensor:
    """P ∈ R^{rows×r}, entries N(0, 1/r)."""
    return torch.randn((rows, rank), generator=generator, device=device, dtype=torch.float32) / math.sqrt(rank)


def signed_permutation_projector(rows: int, rank: int, generator: torch.Generator, device) -> torch.Tensor:
    """Test-only orthonormal P: r columns of a random signed permutation. Adam is equivariant under
    signed permutations, so with r = rows DP-GRAPE must then reproduce DP-Adam exactly."""
    order = torch.randperm(rows, generator=generator, device=device)[:rank]
    signs = torch.randint(0, 2, (rank,), generator=generator, device=device).float() * 2 - 1
    projector = torch.zeros((rows, rank), device=device)
    projector[order, torch.arange(rank, device=device)] = signs
    return projector


PROJECTORS = {"gaussian": gaussian_projector, "signed_permutation": signed_permutation_projector}
Projector = choice_of("Projector", PROJECTORS, __name__)


@dataclass
class GrapeOptions(ProjectedAdamOptions):
    name: str = "grape"
    projector: Projector = Projector.gaussian
    per_sample: PerSample = PerSample.materialize
    projection_seed: Optional[int] = None


class ProjectedLinear:
    """A projected Linear layer's per-example weight gradients, seen through the current P.

    As an Opacus grad sampler (`algo.per_sample=materialize`) it returns [B, r, in] or [B, out, r]
    straight from the layer's input x and output gradient δ; for book-keeping and ghost clipping
    (dpbench.privacy.bookkeeping) it hands over the pair whose outer product is that gradient,
    (x, δP) or (xP, δ), and maps a summed gradient (Σ_i f_i PᵀG_i = Pᵀ Σ_i f_i G_i)."""

    def __init__(self, algorithm: "DPGrape", projection: Projection):
        self.algorithm, self.projection = algorithm, projection

    def pair(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, ..., in], δ [B, ..., out] -> (a', g') with projected G_i = Σ_t g'_tᵀ a'_t."""
        projector = self.algorithm.projector(self.projection, delta.device).to(delta.dtype)
        x = x.to(delta.dtype)
        return (x, delta @ projector) if self.projection.side == "left" else (x @ projector, delta)

    def __call__(self, module: nn.Linear, activations, backprops: torch.Tensor):
        """Opacus grad-sampler signature (loss_reduction=sum); Opacus accumulates the returned
        tensors across calls of a reused module."""
        a, g = self.pair(activations[0], backprops)
        grads = {module.weight: torch.einsum("b...o,b...i->boi", g, a)}  # [B, r, in] or [B, out, r]
        if module.bias is not None and module.bias.requires_grad:
            grads[module.bias] = torch.einsum("b...o->bo", backprops)
        return grads

    def sum_shape(self, param: nn.Parameter) -> torch.Size:
        """The shape of what the hook forms for `param` (the engines' zeros where no hook reached it)."""
        return self.projection.projected_shape if param.dim() == 2 else param.shape

    def map_gradient(self, param: nn.Parameter, gradient: torch.Tensor) -> torch.Tensor:
        if param.dim() != 2:
            return gradient  # the bias stays full
        projector = self.algorithm.projector(self.projection, gradient.device)
        return project(gradient, projector, self.projection.side)


@ALGORITHMS.register("grape", options=GrapeOptions)
class DPGrape(DPFirstOrderAlgorithm):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's (projected) part of its clipped sum to its own C_l
    checkpoint_attributes = ("optimizer.state", "optimizer.step_count", "projection_seed")  # moments; projector seeds
    # train.sharding=fsdp: the projected sums are small, so the whole release is replicated (summed
    # over the ranks, one draw on rank 0, broadcast) and every rank holds the same noisy release
    # and moments; each applies its rows of the full-space update (ProjectedAdam).
    sharded_layout = REPLICATED
    shardable = True

    def __init__(self, model, task, cfg, lr, privacy):
        self.rank = cfg.rank
        self.update_interval = cfg.update_interval
        self.make_projector = PROJECTORS[cfg.projector]
        modules, self.projections = build_projections(model, cfg)
        self.projected_modules = modules
        seed = cfg.projection_seed
        # Projectors are public randomness: a reproducible seed is fine (never used for noise).
        self.projection_seed = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
        self.window = 0  # index of the current F-step projector window
        super().__init__(model, task, cfg, lr, privacy)
        if self.sharded:  # every rank regenerates every P itself: the seeds must be rank 0's
            distributed.check_same_as_rank_zero("DP-GRAPE projection seed", {"projection_seed": self.projection_seed})
        if not modules:
            self.run_notes.append("grape found no layer matching algo.projected_modules; it ran as DP-Adam")

    # --- projectors ----------------------------------------------------------------------
    def layer_seed(self, projection: Projection, window: int) -> int:
        """Independent seed per (window, layer) from one base seed."""
        return int(np.random.SeedSequence([self.projection_seed, window, projection.index]).generate_state(1)[0])

    def projector(self, projection: Projection, device, window: int | None = None) -> torch.Tensor:
        """P (fp32, [projected_dim, r]) of this layer in `window` (default: the current one)."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.layer_seed(projection, self.window if window is None else window))
        return self.make_projector(projection.projected_dim, projection.rank, generator, device)

    # --- per-sample gradients in the hook ------------------------------------------------------
    def sampler_overrides(self):
        return {module: ProjectedLinear(self, self.projections[module.weight]) for module in self.projected_modules.values()}

    def noise_shapes(self):
        return [self.projections[p].projected_shape if p in self.projections else p.shape for p in self.params]

    # --- optimizer ---------------------------------------------------------------------------
    def build_optimizer(self, params):
        return ProjectedAdam(params, self.lr, **adam_config(self.cfg))

    def step(self, batches, step_index: int) -> StepResult:
        self.window = step_index // self.update_interval  # new seeds exactly every F steps
        return super().step(batches, step_index)

    def apply_update(self, gradients):
        projectors = {}
        for i, p in enumerate(self.params):
            if p not in self.projections:
                continue
            projection = self.projections[p]
            projector = self.projector(projection, p.device)  # the hook's P, regenerated from its seed
            # (a layer no hook reached has zeros of its projected shape: ProjectedLinear.sum_shape)
            projectors[p] = (projector, projection.side)
        self.optimizer.step(gradients, projectors)

    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def extra_results(self) -> dict:
        largest = max((proj.projected_dim * proj.rank for proj in self.projections.values()), default=0)
        return {
            **projection_summary(self.projections, self.params),
            "rank": self.rank,
            "update_interval": self.update_interval,
            "projector": self.cfg.projector,
            "projector_bytes": 4 * largest,  # one layer's P at a time (Table 2: r·max m_ℓ)
        }

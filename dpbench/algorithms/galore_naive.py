"""Naive DP-GaLore (DP-GRAPE paper, Algorithm 5): DP-Adam's privatisation of full per-sample
gradients, then GaLore on the noisy batch gradient.

Full per-sample gradients are flat-clipped, summed, noised in full dimension and divided by B,
exactly as DP-Adam (one Gaussian mechanism per step). Every F steps the SVD of each projected
layer's *noisy* batch gradient gives P = U[:, :r] (or V[:, :r] for tall weights); Adam runs in that
subspace and the update is projected back. The SVD sees only privatised gradients, so it is
post-processing. Saves optimizer-state memory but none of the per-sample-gradient memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm
from dpbench.algorithms.projected_adam import (
    ProjectedAdam,
    ProjectedAdamOptions,
    SVDSubspaces,
    adam_config,
    build_projections,
)


@dataclass
class GaloreNaiveOptions(ProjectedAdamOptions):
    name: str = "galore_naive"


@ALGORITHMS.register("galore_naive", options=GaloreNaiveOptions)
class NaiveDPGaLore(DPFirstOrderAlgorithm):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    checkpoint_attributes = ("optimizer.state", "optimizer.step_count", "subspaces.projectors")
    release_carries_state = True  # the projectors, from the SVD of a release, shape the following updates

    def __init__(self, model, task, cfg, lr, privacy):
        _, projections = build_projections(model, cfg)
        self.subspaces = SVDSubspaces(projections, cfg.update_interval)
        super().__init__(model, task, cfg, lr, privacy)

    def build_optimizer(self, params):
        return ProjectedAdam(params, self.lr, **adam_config(self.cfg))

    def apply_update(self, gradients):
        self.subspaces.projected_step(self.optimizer, self.params, gradients)

    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def extra_results(self) -> dict:
        return self.subspaces.summary(self.params, self.cfg.rank)

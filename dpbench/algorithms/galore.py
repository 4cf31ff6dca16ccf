"""GaLore (Zhao et al. 2024; DP-GRAPE paper, Algorithm 4): non-private Adam with moments in the
subspace of the top-r singular vectors of each projected layer's batch gradient, refreshed every F
steps. The non-private reference for naive DP-GaLore and DP-GRAPE (no GaLore `scale`: 1.0, as
the DP-GRAPE reference code uses)."""

from __future__ import annotations

from dpbench.algorithms.base import ALGORITHMS, Algorithm, StepResult
from dpbench.algorithms.projected_adam import (
    ProjectedAdam,
    ProjectedAdamOptions,
    SVDSubspaces,
    adam_config,
    build_projections,
)


@ALGORITHMS.register("galore", options=ProjectedAdamOptions)
class GaLore(Algorithm):
    checkpoint_attributes = ("optimizer.state", "optimizer.step_count", "subspaces.projectors")
    private = False

    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        _, projections = build_projections(model, cfg)
        self.subspaces = SVDSubspaces(projections, cfg.update_interval)
        self.optimizer = ProjectedAdam(self.params, lr, **adam_config(cfg))

    def step(self, batches, step_index: int) -> StepResult:
        tally = self.backward_mean_loss(batches)
        if tally.count == 0:
            return tally.result()
        gradients = [p.grad if p.grad is not None else p.new_zeros(p.shape) for p in self.params]
        self.subspaces.projected_step(self.optimizer, self.params, gradients)
        for p in self.params:
            p.grad = None
        return tally.result()

    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def extra_results(self) -> dict:
        return self.subspaces.summary(self.params, self.cfg.rank)

"""Non-private Adam: the accuracy and memory reference for every private algorithm."""

from __future__ import annotations

import torch

from dpbench.algorithms.base import ALGORITHMS, Algorithm, StepResult, torch_optimizer_state_bytes


@ALGORITHMS.register("adam")
class Adam(Algorithm):
    private = False

    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(
            self.params, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )

    def step(self, batches, step_index: int) -> StepResult:
        loss, total = self.backward_mean_loss(batches)
        if total:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, total)

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)

"""Non-private SGD with momentum and weight decay: the "non-DP" column of DC-DPSGD Table 2."""

from __future__ import annotations

import torch

from dpbench.algorithms.base import ALGORITHMS, Algorithm, StepResult, torch_optimizer_state_bytes
from dpbench.errors import UserError


@ALGORITHMS.register("sgd")
class SGD(Algorithm):
    private = False  # no clipping, no noise, nothing in the ledger

    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(model, task, cfg, lr, privacy)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if cfg.nesterov and not cfg.momentum > 0:
            raise UserError(f"algo.nesterov=true needs a positive algo.momentum (got {cfg.momentum})")
        self.optimizer = torch.optim.SGD(
            self.params, lr=lr, momentum=float(cfg.momentum), nesterov=bool(cfg.nesterov),
            weight_decay=float(cfg.weight_decay),
        )

    def step(self, batches, step_index: int) -> StepResult:
        loss, total = self.backward_mean_loss(batches)
        if total:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, total)

    def optimizer_state_bytes(self) -> int:
        return torch_optimizer_state_bytes(self.optimizer)  # momentum buffers (none at momentum 0)

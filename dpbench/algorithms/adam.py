"""Non-private Adam: the accuracy and memory reference for every private algorithm."""

from __future__ import annotations

import torch

from dpbench.algorithms.base import ALGORITHMS, NonPrivateOptimizerAlgorithm


@ALGORITHMS.register("adam")
class Adam(NonPrivateOptimizerAlgorithm):
    def build_optimizer(self, params):
        cfg = self.cfg
        return torch.optim.Adam(params, lr=self.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)

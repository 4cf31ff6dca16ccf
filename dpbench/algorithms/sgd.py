"""Non-private SGD with momentum and weight decay: the "non-DP" column of DC-DPSGD Table 2."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.learning_rates import lr_groups
from dpbench.algorithms.base import ALGORITHMS, NonPrivateOptimizerAlgorithm
from dpbench.errors import UserError
from dpbench.options import AlgoOptions, LrFamily


@dataclass
class SGDOptions(AlgoOptions):
    name: str = "sgd"
    default_lr: float = 0.3  # conf/algo/sgd.yaml says where it comes from
    lr_family: LrFamily = LrFamily.sgd
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@ALGORITHMS.register("sgd", options=SGDOptions)
class SGD(NonPrivateOptimizerAlgorithm):
    def build_optimizer(self, params):
        cfg = self.cfg
        if cfg.nesterov and not cfg.momentum > 0:
            raise UserError(f"algo.nesterov=true needs a positive algo.momentum (got {cfg.momentum})")
        return torch.optim.SGD(
            lr_groups(params, self.lr), lr=self.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
        )

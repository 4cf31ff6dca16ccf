"""DP-SGD (Abadi et al. 2016): clipped per-example gradients, Gaussian noise, SGD.

`privacy.clipping` picks the clipping rule: flat (Abadi), automatic (Auto-S / NSGD), psac, or per_layer
(each parameter tensor to its own C_l, Σ_l C_l² = C²): every one of sensitivity C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.learning_rates import lr_groups
from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample
from dpbench.options import AlgoOptions, LrFamily


@dataclass
class DPSGDOptions(AlgoOptions):
    name: str = "dpsgd"
    default_lr: float = 3.0  # conf/algo/dpsgd.yaml says where it comes from
    lr_family: LrFamily = LrFamily.sgd
    momentum: float = 0.0
    weight_decay: float = 0.0
    per_sample: PerSample = PerSample.materialize


@ALGORITHMS.register("dpsgd", options=DPSGDOptions)
class DPSGD(DPFirstOrderAlgorithm):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    shardable = True  # train.sharding=fsdp: its clipped sums reduce-scattered as formed (dpbench/runtime/sharding.py)

    def build_optimizer(self, params):
        return torch.optim.SGD(lr_groups(params, self.lr), lr=self.lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay)

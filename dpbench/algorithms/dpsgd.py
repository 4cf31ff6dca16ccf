"""DP-SGD (Abadi et al. 2016): clipped per-example gradients, Gaussian noise, SGD.

`privacy.clipping` picks the clipping rule: flat (Abadi), automatic (Auto-S / NSGD) or psac.
"""

from __future__ import annotations

import torch

from dpbench.algorithms.base import ALGORITHMS, DPFirstOrderAlgorithm


@ALGORITHMS.register("dpsgd")
class DPSGD(DPFirstOrderAlgorithm):
    def build_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay)

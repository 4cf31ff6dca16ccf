"""DP-Adam: DP-SGD's privatised gradient fed to Adam (DP-GRAPE paper, Algorithm 3).

Adam only post-processes the noisy gradient, so its privacy is that of DP-SGD.
"""

from __future__ import annotations

import torch

from dpbench.algorithms.base import ALGORITHMS, DPFirstOrderAlgorithm


@ALGORITHMS.register("dpadam")
class DPAdam(DPFirstOrderAlgorithm):
    def build_optimizer(self, params):
        return torch.optim.Adam(
            params, lr=self.lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps, weight_decay=self.cfg.weight_decay
        )

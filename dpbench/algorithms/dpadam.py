"""DP-Adam: DP-SGD's privatised gradient fed to Adam (DP-GRAPE paper, Algorithm 3).

Adam only post-processes the noisy gradient, so its privacy is that of DP-SGD.
"""

from __future__ import annotations

from dpbench.algorithms.base import ALGORITHMS, DPFirstOrderAlgorithm, adam


@ALGORITHMS.register("dpadam")
class DPAdam(DPFirstOrderAlgorithm):
    def build_optimizer(self, params):
        return adam(params, self.lr, self.cfg)

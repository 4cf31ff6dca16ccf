"""Non-private Adam: the accuracy and memory reference for every private algorithm."""

from __future__ import annotations

from dpbench.algorithms.base import ALGORITHMS, NonPrivateOptimizerAlgorithm, adam


@ALGORITHMS.register("adam")
class Adam(NonPrivateOptimizerAlgorithm):
    def build_optimizer(self, params):
        return adam(params, self.lr, self.cfg)

"""Non-private Adam: the accuracy and memory reference for every private algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from dpbench.algorithms.base import ALGORITHMS, NonPrivateOptimizerAlgorithm, adam, adam_betas
from dpbench.options import AlgoOptions


@dataclass
class AdamOptions(AlgoOptions):
    name: str = "adam"
    betas: List[float] = field(default_factory=adam_betas)
    eps: float = 1.0e-8
    weight_decay: float = 0.0


@ALGORITHMS.register("adam", options=AdamOptions)
class Adam(NonPrivateOptimizerAlgorithm):
    def build_optimizer(self, params):
        return adam(params, self.lr, self.cfg)

"""MeZO (Malladi et al., NeurIPS 2023): DPZero's two-point estimator without clipping or noise.

The non-private reference for DPZero: g = mean_i s_i over the realised batch, then the same
in-place SGD step along the regenerated direction (see dpzero.py for the machinery).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpbench.algorithms.base import ALGORITHMS, StepResult
from dpbench.algorithms.dpzero import ZerothOrderAlgorithm, ZerothOrderOptions


@dataclass
class MeZOOptions(ZerothOrderOptions):
    name: str = "mezo"


@ALGORITHMS.register("mezo", options=MeZOOptions)
class MeZO(ZerothOrderAlgorithm):
    private = False

    def step(self, batches, step_index: int) -> StepResult:
        seed = self.next_seed()
        scale = self.direction_scale(seed)
        total, loss, count = self.estimate(batches, seed, scale, clip=None)
        if count:
            self.apply_update(seed, scale, total / count)
        return StepResult(loss, count)

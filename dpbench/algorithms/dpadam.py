"""DP-Adam: DP-SGD's privatised gradient fed to Adam (DP-GRAPE paper, Algorithm 3).

Adam only post-processes the noisy gradient, so its privacy is that of DP-SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpbench.algorithms.adam import AdamOptions
from dpbench.algorithms.base import ALGORITHMS, adam
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample


@dataclass
class DPAdamOptions(AdamOptions):
    name: str = "dpadam"
    per_sample: PerSample = PerSample.materialize


@ALGORITHMS.register("dpadam", options=DPAdamOptions)
class DPAdam(DPFirstOrderAlgorithm):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    shardable = True  # train.sharding=fsdp: its clipped sums reduce-scattered as formed (dpbench/runtime/sharding.py)

    def build_optimizer(self, params):
        return adam(params, self.lr, self.cfg)

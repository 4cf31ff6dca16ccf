"""DP-LoRA: DP-Adam on LoRA adapters only (the DPZero / DP-GRAPE papers' DP-LoRA baseline).

Adapters are injected (peft, rank 8, alpha 16 by default) before the per-sample-gradient engine
is built, so Opacus hooks see only adapter Linear layers as trainable: per-example clipping and
Gaussian noise act on the adapter parameters alone, whose sum has sensitivity C as in DP-SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.dpadam import DPAdam
from dpbench.algorithms.lora import LoRAOptions
from dpbench.models.lora import inject_lora


@dataclass
class DPLoRAOptions(LoRAOptions):
    name: str = "dplora"


@ALGORITHMS.register("dplora", options=DPLoRAOptions)
class DPLoRA(DPAdam):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    shardable = False  # train.sharding=fsdp: LoRA's injected adapters are not sharded (untested there)
    libraries = ("peft",)  # the adapters
    trained_modules_option = "train_modules"  # trained in full beside the adapters (the one-run audit's canary layer)

    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(inject_lora(model, cfg), task, cfg, lr, privacy)

"""Non-private LoRA (Adam on peft LoRA adapters): the reference for DP-LoRA."""

from __future__ import annotations

from dpbench.algorithms.adam import Adam
from dpbench.algorithms.base import ALGORITHMS
from dpbench.models.lora import inject_lora


@ALGORITHMS.register("lora")
class LoRA(Adam):
    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(inject_lora(model, cfg), task, cfg, lr, privacy)

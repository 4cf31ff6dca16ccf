"""Non-private LoRA (Adam on peft LoRA adapters): the reference for DP-LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from dpbench.algorithms.adam import Adam
from dpbench.algorithms.base import ALGORITHMS, adam_betas
from dpbench.models.lora import inject_lora
from dpbench.options import AlgoOptions


@dataclass
class LoRAOptions(AlgoOptions):
    name: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[List[str]] = None
    train_modules: Optional[List[str]] = None
    betas: List[float] = field(default_factory=adam_betas)
    eps: float = 1.0e-8
    weight_decay: float = 0.0


@ALGORITHMS.register("lora", options=LoRAOptions)
class LoRA(Adam):
    libraries = ("peft",)  # the adapters
    trained_modules_option = "train_modules"  # trained in full beside the adapters (the one-run audit's canary layer)

    def __init__(self, model, task, cfg, lr, privacy=None):
        super().__init__(inject_lora(model, cfg), task, cfg, lr, privacy)

"""DP-BiTFiT (Bu et al. 2022, "Differentially private bias-term only fine-tuning"): DP-Adam on the
model's bias terms and its classification head only; every other weight is frozen.

Private update: DP-Adam's, as the paper runs it (its experiments train the biases with DP-Adam,
at larger rates than full fine-tuning), unchanged: the trained parameters' per-example gradients
are clipped together to C, summed, noised once with N(0, σ²C²) per coordinate and divided by the
expected batch size qn; Adam's moments post-process the noisy gradient.

Sensitivity: adding or removing one example moves the clipped sum over the trained parameters
(biases and head) by at most C in L2 (2C under replace-one), as in DP-SGD; the frozen weights
receive no gradient and release nothing, so each step is one Poisson-subsampled Gaussian
mechanism with noise multiplier σ and ε is DP-Adam's for the same σ, q and T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from torch import nn

from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.dpadam import DPAdam, DPAdamOptions
from dpbench.models import ModelFamily, family_of


@dataclass
class DPBiTFiTOptions(DPAdamOptions):
    name: str = "dpbitfit"
    # modules trained in full beside the biases; null: the model family's head (ViT [head]; none named: biases only)
    train_modules: Optional[List[str]] = None


def is_bias(name: str) -> bool:
    """A bias term: a parameter registered as `bias` on its module (Linear, conv, norm layers)."""
    return name.rsplit(".", 1)[-1] == "bias"


def train_biases_and_head(model: nn.Module, cfg) -> list[str]:
    """Freeze every parameter but the biases and `train_modules` (the head); the trained modules' names."""
    trained = list(cfg.train_modules) if cfg.get("train_modules") is not None \
        else list((family_of(model) or ModelFamily()).trained_modules)
    for name, param in model.named_parameters():
        param.requires_grad = is_bias(name) or any(name.startswith(m + ".") for m in trained)
    return trained


@ALGORITHMS.register("dpbitfit", options=DPBiTFiTOptions)
class DPBiTFiT(DPAdam):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    shardable = False  # train.sharding=fsdp: not tried with frozen weights beside sharded biases
    trained_modules_option = "train_modules"  # trained in full beside the biases (the one-run audit's canaries)
    # a fine-tuning method: on the from-scratch micro ViT the biases and head alone stay at chance
    # (0.097 at DP-Adam's rate; docs/running.md), so the default job is not its test
    learns_default_job = False

    def __init__(self, model, task, cfg, lr, privacy):
        trained = train_biases_and_head(model, cfg)
        super().__init__(model, task, cfg, lr, privacy)
        if not trained:
            self.run_notes.append(f"algo=dpbitfit: a {type(model).__name__} model names no head (its family's "
                                  "trained_modules), so only the biases train; set algo.train_modules=[...]")

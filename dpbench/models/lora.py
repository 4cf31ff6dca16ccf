"""LoRA adapters through `peft`, injected in place (the model object stays the same).

Only the adapters (and `train_modules`, e.g. a ViT's fresh classifier head) stay trainable, in
fp32 whatever model.dtype the frozen base model holds.
Targets and trained modules default to the model family's record (`lora_targets`,
`trained_modules` in dpbench/models): RoBERTa query/value and OPT q_proj/v_proj (MeZO's and the
DPZero paper's LoRA baseline: rank 8, alpha 16), timm ViT `qkv` with its head trained.
peft is pinned by test: tests/models/test_language.py checks that the adapters' per-sample gradients
under Opacus equal per-example autograd gradients (some peft releases silently broke this).
"""

from __future__ import annotations

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models import ModelFamily, family_of


def inject_lora(model: nn.Module, cfg) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    family = family_of(model) or ModelFamily()
    own = getattr(model, "lora_targets", None)  # a model that trains only some layers names their modules
    targets = list(cfg.target_modules) if cfg.get("target_modules") else list(
        family.lora_targets if own is None else own)
    if not targets:
        raise UserError(f"algo={cfg.name}: no default LoRA targets for a {type(model).__name__} model; "
                        "set algo.target_modules=[...]")
    trained = list(cfg.train_modules) if cfg.get("train_modules") is not None else list(family.trained_modules)
    config = LoraConfig(r=int(cfg.rank), lora_alpha=float(cfg.alpha), lora_dropout=float(cfg.get("dropout", 0.0)),
                        target_modules=targets, bias="none")
    try:
        model = inject_adapter_in_model(config, model)
    except ValueError as error:
        raise UserError(f"algo={cfg.name}: {error}; set algo.target_modules to Linear layer names") from error
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name or any(name.startswith(m + ".") for m in trained)
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            # peft makes adapters in the base layer's dtype; a bf16/fp16 base (model.dtype) stays
            # low and frozen, the weights that train get an fp32 copy (else small updates are lost)
            param.data = param.data.float()
    return model

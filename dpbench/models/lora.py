"""LoRA adapters through `peft`, injected in place (the model object stays the same).

Only the adapters (and `train_modules`, e.g. a ViT's fresh classifier head) stay trainable.
Targets default per model family: RoBERTa query/value and OPT q_proj/v_proj (MeZO's and the
DPZero paper's LoRA baseline: rank 8, alpha 16), timm ViT `qkv`.
peft is pinned by test: tests/test_language.py checks that the adapters' per-sample gradients
under Opacus equal per-example autograd gradients (some peft releases silently broke this).
"""

from __future__ import annotations

from torch import nn

from dpbench.errors import UserError

DEFAULT_TARGETS = {"roberta": ["query", "value"], "opt": ["q_proj", "v_proj"], "vit": ["qkv"]}
DEFAULT_TRAINED = {"vit": ["head"]}  # a from-scratch image head must learn; LM heads stay frozen


def model_family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None):
        return config.model_type
    return "vit" if any(name.endswith("qkv") for name, _ in model.named_modules()) else type(model).__name__


def inject_lora(model: nn.Module, cfg) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    family = model_family(model)
    targets = list(cfg.target_modules) if cfg.get("target_modules") else DEFAULT_TARGETS.get(family)
    if not targets:
        raise UserError(f"algo={cfg.name}: no default LoRA targets for a {family} model; set algo.target_modules=[...]")
    trained = list(cfg.train_modules) if cfg.get("train_modules") is not None else DEFAULT_TRAINED.get(family, [])
    config = LoraConfig(r=int(cfg.rank), lora_alpha=float(cfg.alpha), lora_dropout=float(cfg.dropout),
                        target_modules=targets, bias="none")
    try:
        model = inject_adapter_in_model(config, model)
    except ValueError as error:
        raise UserError(f"algo={cfg.name}: {error}; set algo.target_modules to Linear layer names") from error
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name or any(name.startswith(m + ".") for m in trained)
    return model

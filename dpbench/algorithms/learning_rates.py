"""Per-parameter learning-rate scales: `train.head_lr_scale` (the fresh head's step beside a
pretrained body's).

A pretrained encoder with a freshly initialised head is fine-tuned with one learning rate for the
body and a larger one for the head (timm's and Hugging Face's "layer-wise" or "classifier" learning
rates). The head is what the model's family record declares stays trained beside LoRA adapters
(`ModelFamily.trained_modules`: BERT's `classifier`, ViT's `head`). The scale is set on each head
parameter as an attribute (as Opacus keeps `grad_sample` on the parameter) and every optimizer reads
it: torch optimizers through parameter groups (`lr_groups`), dpbench's own updates (DP-GRAPE's
projected Adam, DPZero, MeZO) through `lr_scale`. The learning rate post-processes the privatised
gradient, so the scale changes no privacy guarantee.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from dpbench.errors import UserError

LR_SCALE_ATTRIBUTE = "dpbench_lr_scale"


def lr_scale(param: nn.Parameter) -> float:
    """The parameter's learning-rate multiplier (1 unless `train.head_lr_scale` marked it)."""
    return getattr(param, LR_SCALE_ATTRIBUTE, 1.0)


def lr_groups(params: list[nn.Parameter], lr: float) -> list[dict]:
    """torch optimizer parameter groups: one per distinct scale, in first-seen order (one group
    when nothing is scaled, so optimizer state dicts keep their usual shape)."""
    groups: dict[float, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(lr_scale(p), []).append(p)
    return [{"params": members, "lr": lr * scale} for scale, members in groups.items()]


def mark_head(model: nn.Module, head_patterns: tuple[str, ...], scale: float, model_name: str) -> int:
    """Give the trainable parameters of the modules matching `head_patterns` the learning-rate
    multiplier `scale`; returns how many parameters were marked. A scale other than 1 on a model
    with no declared head is a one-line error."""
    if scale == 1.0:
        return 0
    if not scale > 0:
        raise UserError(f"train.head_lr_scale must be positive, got {scale}")
    marked = 0
    for name, module in model.named_modules():
        if name and any(fnmatchcase(name, pattern) for pattern in head_patterns):  # as LoRA keeps it trained
            for p in module.parameters():
                if p.requires_grad and lr_scale(p) == 1.0:
                    setattr(p, LR_SCALE_ATTRIBUTE, float(scale))
                    marked += 1
    if not marked:
        raise UserError(f"train.head_lr_scale={scale}: model={model_name} declares no trainable head to scale; "
                        "leave train.head_lr_scale=1")
    return marked

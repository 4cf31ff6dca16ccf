"""Vision Transformer from timm, with every parameter inside a leaf module.

timm's VisionTransformer keeps `cls_token` and `pos_embed` as parameters of the top-level module.
Opacus computes per-sample gradients per module, and a module that owns parameters directly is
handed whole to functorch, which would take the entire ViT through vmap and hide the Linear
layers from the hooks DP-GRAPE projects in. `DPViT` moves those two parameters into a
`TokenEmbedding` submodule; the function computed is unchanged (class token prepended, then
learned position embedding added, as in timm's default `_pos_embed`).

Pretrained fine-tuning (DP-GRAPE Table 9): `model.pretrained=<timm name>` with `model.path=<local
checkpoint>` (.safetensors / .pth / .bin, or timm's .npz for the original JAX weights). timm
loads the file (never the hub), adapts the patch embedding to the dataset's channels, and drops
the checkpoint's classifier so a fresh head for the dataset's classes is built. The dataset's
images keep their size in memory; the model's forward resizes them (bilinear F.interpolate) to
the checkpoint's resolution, so the learned position embeddings are used as pretrained.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from dpbench.errors import UserError
from dpbench.models import DataSpec, ModelFamily, register_model

# Size presets. tiny / small / base are ViT-Ti / ViT-S / ViT-B (Dosovitskiy et al.; Touvron et
# al.), base as in the DP-GRAPE paper. micro and mini are sized for CPU runs on small images
# (micro is the default job's model).
VIT_SIZES = {
    "micro": dict(embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0),  # 69k parameters on digits
    "mini": dict(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),  # 2.7M
    "tiny": dict(embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),  # ViT-Ti, 5.5M
    "small": dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),  # ViT-S, 21.7M
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),  # ViT-B, 85M
}


class TokenEmbedding(nn.Module):
    """Prepends the class token and adds the learned position embedding: [B, N, D] -> [B, N+1, D]."""

    def __init__(self, cls_token: torch.Tensor, pos_embed: torch.Tensor):
        super().__init__()
        self.cls_token = nn.Parameter(cls_token.detach().clone())  # [1, 1, D]
        self.pos_embed = nn.Parameter(pos_embed.detach().clone())  # [1, N+1, D]

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        return torch.cat([cls, patches], dim=1) + self.pos_embed


class DPViT(VisionTransformer):
    input_resolution: tuple[int, int] | None = None  # resize inputs to this (pretrained checkpoints)

    def __init__(self, **kwargs):
        super().__init__(class_token=True, pos_embed="learn", **kwargs)
        move_tokens_into_submodule(self)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # timm's PatchEmbed may return NHWC with dynamic sizes
            x = x.flatten(1, 2)
        return self.pos_drop(self.token_embedding(x))

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.input_resolution is not None and tuple(x.shape[-2:]) != self.input_resolution:
            x = F.interpolate(x, size=self.input_resolution, mode="bilinear", align_corners=False)
        return super().forward_features(x, *args, **kwargs)


def move_tokens_into_submodule(vit: VisionTransformer) -> None:
    vit.token_embedding = TokenEmbedding(vit.cls_token, vit.pos_embed)
    del vit.cls_token
    del vit.pos_embed
    vit.cls_token = None
    vit.pos_embed = None


VIT_FAMILY = ModelFamily(
    # The Linears of the transformer blocks (the paper projects attention Q/K/V/out and MLP
    # fc1/fc2; patch embedding, head, norms and biases stay full).
    projected_modules=("blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc1", "blocks.*.mlp.fc2"),
    lora_targets=("qkv",),
    trained_modules=("head",),  # a from-scratch image head must learn beside the adapters
    block_modules=("blocks.*",),  # train.sharding=fsdp wraps each block
    libraries=("timm",),
)


@register_model("vit", VIT_FAMILY)
def build_vit(cfg, spec: DataSpec) -> nn.Module:
    if cfg.get("pretrained"):
        return build_pretrained_vit(cfg, spec)
    if cfg.size not in VIT_SIZES:
        raise UserError(f"model.size={cfg.size!r} is not a ViT preset; use one of {', '.join(VIT_SIZES)}")
    preset = dict(VIT_SIZES[cfg.size])
    for key in ("embed_dim", "depth", "num_heads", "mlp_ratio"):
        if cfg.get(key) is not None:
            preset[key] = cfg[key]
    patch_size = cfg.get("patch_size") or spec.patch_size
    return DPViT(
        img_size=spec.image_size,
        patch_size=patch_size,
        in_chans=spec.channels,
        num_classes=spec.num_classes,
        global_pool="token",
        drop_rate=cfg.get("dropout", 0.0),
        **preset,
    )


def build_pretrained_vit(cfg, spec: DataSpec) -> nn.Module:
    """timm's `cfg.pretrained` architecture with the weights of the local file `cfg.path`."""
    import timm

    name, path = str(cfg.pretrained), cfg.get("path")
    if not path or not Path(str(path)).expanduser().is_file():
        raise UserError(
            f"model.pretrained={name} needs its weights offline: model.path={path} is not a file; download the "
            f"checkpoint (e.g. the hub's timm/{name} model.safetensors) and set model.path=FILE"
        )
    path = str(Path(str(path)).expanduser())
    overlay = dict(file=path, source="", custom_load=path.endswith(".npz"))  # a local file, never the hub
    try:
        vit = timm.create_model(
            name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=spec.num_classes,
            in_chans=spec.channels, drop_rate=cfg.get("dropout", 0.0),
            dynamic_img_size=False,  # inputs are resized to the checkpoint's resolution instead
        )
    except RuntimeError as error:  # shapes of the file do not fit the named architecture
        raise UserError(f"model.path={path} does not hold {name} weights ({str(error).splitlines()[0]})") from error
    if not isinstance(vit, VisionTransformer) or vit.cls_token is None or vit.pos_embed is None \
            or vit.no_embed_class or vit.num_reg_tokens:
        raise UserError(f"model.pretrained={name}: only timm ViTs with a class token and learned position embedding are supported")
    move_tokens_into_submodule(vit)
    vit.__class__ = DPViT  # same module tree; DPViT only reads the tokens from their submodule
    vit.input_resolution = tuple(vit.patch_embed.img_size)
    return vit

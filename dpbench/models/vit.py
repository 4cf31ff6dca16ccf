"""Vision Transformer from timm, with every parameter inside a leaf module.

timm's VisionTransformer keeps `cls_token` and `pos_embed` as parameters of the top-level module.
Opacus computes per-sample gradients per module, and a module that owns parameters directly is
handed whole to functorch, which would take the entire ViT through vmap and hide the Linear
layers from the hooks DP-GRAPE projects in. `DPViT` moves those two parameters into a
`TokenEmbedding` submodule; the function computed is unchanged (class token prepended, then
learned position embedding added, as in timm's default `_pos_embed`).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from dpbench.models import MODELS, DataSpec

# Size presets. base is ViT-Base (85M, as in the DP-GRAPE paper); tiny and small are sized for
# CPU runs on small images.
VIT_SIZES = {
    "tiny": dict(embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0),
    "small": dict(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
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
    def __init__(self, **kwargs):
        super().__init__(class_token=True, pos_embed="learn", **kwargs)
        self.token_embedding = TokenEmbedding(self.cls_token, self.pos_embed)
        del self.cls_token
        del self.pos_embed
        self.cls_token = None
        self.pos_embed = None

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # timm's PatchEmbed may return NHWC with dynamic sizes
            x = x.flatten(1, 2)
        return self.pos_drop(self.token_embedding(x))


@MODELS.register("vit")
def build_vit(cfg, spec: DataSpec) -> nn.Module:
    if cfg.size not in VIT_SIZES:
        from dpbench.errors import UserError

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

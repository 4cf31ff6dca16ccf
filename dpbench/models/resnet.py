"""ResNet-9 and ResNet-18 with GroupNorm (BatchNorm mixes examples, which breaks per-example DP).

resnet9   the DAWNBench/Myrtle ResNet-9 used by Auto-S and DC-DPSGD on ImageNette: prep conv
          -> [conv-pool, residual] -> conv-pool -> [conv-pool, residual] -> global max pool ->
          linear, every conv 3x3 + GroupNorm + activation. Channels width*(1, 2, 4, 8)
          (width 64: 6.6M parameters; DC-DPSGD's code uses a 2.5M variant, width 40 is close:
          2.6M). GroupNorm(groups, affine) and the activation (mish in the DC-DPSGD code) are
          configurable.
resnet18  torchvision's ResNet-18 with norm_layer = GroupNorm (pure-Python model code; only
          torchvision's compiled ops are unavailable here and none are used). `stem: cifar`
          swaps the 7x7/stride-2 stem and max pool for one 3x3 conv (32x32 inputs).
"""

from __future__ import annotations

import types

from torch import nn

from dpbench.models import DataSpec, register_model

ACTIVATIONS = {"relu": nn.ReLU, "mish": nn.Mish, "tanh": nn.Tanh}


def _conv_block(cin: int, cout: int, groups: int, affine: bool, activation: str, pool: bool) -> nn.Sequential:
    layers = [
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.GroupNorm(min(groups, cout), cout, affine=affine),
        ACTIVATIONS[activation](),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


@register_model("resnet9")
def build_resnet9(cfg, spec: DataSpec) -> nn.Module:
    width = int(cfg.get("width", 64))
    groups, affine, act = int(cfg.get("groups", 4)), bool(cfg.get("affine", False)), cfg.get("activation", "mish")

    def block(cin, cout, pool=False):
        return _conv_block(cin, cout, groups, affine, act, pool)

    c1, c2, c3, c4 = width, 2 * width, 4 * width, 8 * width
    return nn.Sequential(
        block(spec.channels, c1),
        block(c1, c2, pool=True),
        _Residual(nn.Sequential(block(c2, c2), block(c2, c2))),
        block(c2, c3, pool=True),
        block(c3, c4, pool=True),
        _Residual(nn.Sequential(block(c4, c4), block(c4, c4))),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(c4, spec.num_classes),
    )


@register_model("resnet18")
def build_resnet18(cfg, spec: DataSpec) -> nn.Module:
    from torchvision.models import resnet18
    from torchvision.models.resnet import BasicBlock

    groups = int(cfg.get("groups", 32))
    model = resnet18(num_classes=spec.num_classes, norm_layer=lambda c: nn.GroupNorm(min(groups, c), c))
    if cfg.get("stem", "cifar") == "cifar":
        model.conv1 = nn.Conv2d(spec.channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif spec.channels != 3:
        model.conv1 = nn.Conv2d(spec.channels, 64, 7, stride=2, padding=3, bias=False)
    # Opacus's backward hooks forbid in-place ops on hooked module outputs (the block's
    # `out += identity` and inplace ReLU): make both out-of-place.
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
        if isinstance(module, BasicBlock):
            module.forward = types.MethodType(_basic_block_forward, module)
    return model


def _basic_block_forward(self, x):
    """torchvision's BasicBlock.forward with an out-of-place residual add."""
    identity = x if self.downsample is None else self.downsample(x)
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    return self.relu(out + identity)

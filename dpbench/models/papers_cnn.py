"""The CNNs of the DC-DPSGD and DPDR papers (after Papernot et al. 2021 / Tramer & Boneh 2021).

tanh_cnn  (MNIST/FashionMNIST, "4-layer CNN"): Conv(C->16, k8, s2, p2) - tanh - MaxPool(2, s1)
          - Conv(16->32, k4, s2) - tanh - MaxPool(2, s1) - Linear(512->32) - tanh - Linear(32->K).
          ~26k parameters at 28x28. `group_norm: true` inserts GroupNorm after each conv
          (the DC-DPSGD paper says GN; its code has none, so the default is none).
cnn5      (CIFAR-10, the DPDR paper's "5-layer CNN" with GroupNorm; the paper gives no layout):
          3 conv blocks [Conv3x3(pad 1) - GroupNorm - tanh - MaxPool(2)] with 32, 64, 128
          channels, then Linear(128*(H/8)^2 -> 128) - tanh - Linear(128 -> K): 5 weight layers,
          ~357k parameters at 32x32. Tramer & Boneh's CIFAR CNN has 8 weight layers (two convs
          per block); `convs_per_block: 2` builds that one.
"""

from __future__ import annotations

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models import DataSpec, register_model


def _flat_size(features: nn.Module, spec: DataSpec) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, spec.channels, spec.image_size, spec.image_size)).numel()


@register_model("tanh_cnn")
def build_tanh_cnn(cfg, spec: DataSpec) -> nn.Module:
    groups = int(cfg.get("groups", 4))
    norm = (lambda c: [nn.GroupNorm(min(groups, c), c)]) if cfg.get("group_norm", False) else (lambda c: [])
    # The layout is for 28x28; on smaller inputs (8x8 digits) the second conv is padded and a
    # max pool on a 1x1 map is skipped, so the same model runs everywhere.
    size = (spec.image_size + 4 - 8) // 2 + 1
    if size < 1:
        raise UserError(f"model=tanh_cnn needs images of at least 4x4, got {spec.image_size}")
    layers: list[nn.Module] = [nn.Conv2d(spec.channels, 16, 8, stride=2, padding=2), *norm(16), nn.Tanh()]
    if size >= 2:
        layers.append(nn.MaxPool2d(2, 1))
        size -= 1
    pad = max(0, -(-(4 - size) // 2))
    layers += [nn.Conv2d(16, 32, 4, stride=2, padding=pad), *norm(32), nn.Tanh()]
    size = (size + 2 * pad - 4) // 2 + 1
    if size >= 2:
        layers.append(nn.MaxPool2d(2, 1))
    features = nn.Sequential(*layers, nn.Flatten())
    hidden = int(cfg.get("hidden", 32))
    return nn.Sequential(
        features, nn.Linear(_flat_size(features, spec), hidden), nn.Tanh(), nn.Linear(hidden, spec.num_classes)
    )


@register_model("cnn5")
def build_cnn5(cfg, spec: DataSpec) -> nn.Module:
    groups = int(cfg.get("groups", 8))
    per_block = int(cfg.get("convs_per_block", 1))
    layers: list[nn.Module] = []
    channels = spec.channels
    for width in cfg.get("widths", [32, 64, 128]):
        for _ in range(per_block):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(min(groups, width), width), nn.Tanh()]
            channels = width
        layers.append(nn.MaxPool2d(2))
    layers.append(nn.Flatten())
    features = nn.Sequential(*layers)
    hidden = int(cfg.get("hidden", 128))
    return nn.Sequential(
        features, nn.Linear(_flat_size(features, spec), hidden), nn.Tanh(), nn.Linear(hidden, spec.num_classes)
    )

"""A small convolutional network with GroupNorm (BatchNorm mixes examples, which breaks DP)."""

from __future__ import annotations

from torch import nn

from dpbench.models import DataSpec, register_model


@register_model("cnn")
def build_cnn(cfg, spec: DataSpec) -> nn.Module:
    width = cfg.get("width", 32)
    groups = cfg.get("groups", 8)
    layers: list[nn.Module] = []
    channels, size = spec.channels, spec.image_size
    for multiplier in (1, 2):
        out = width * multiplier
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.GroupNorm(min(groups, out), out), nn.Tanh()]
        channels = out
        if size >= 8:
            layers.append(nn.AvgPool2d(2))
            size //= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, spec.num_classes)]
    return nn.Sequential(*layers)

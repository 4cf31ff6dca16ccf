"""Model builders, by name (`model=...`). Each builder takes the model config and a DataSpec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from dpbench.registry import Registry


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about the task's inputs and outputs."""

    num_classes: int
    channels: int = 1
    image_size: int = 8
    patch_size: int = 2  # the dataset's ViT patch size (image_size / patch_size tokens per side)


MODELS: Registry[Callable[..., nn.Module]] = Registry("model")


def build_model(model_cfg, spec: DataSpec) -> nn.Module:
    _import_builders()
    return MODELS.get(model_cfg.name)(model_cfg, spec)


def _import_builders() -> None:
    # Importing the modules registers their builders.
    from dpbench.models import cnn, papers_cnn, resnet, vit  # noqa: F401

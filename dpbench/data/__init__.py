"""Datasets, by name (`dataset=...`). A loader returns an ImageDataset (train and test tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dpbench.registry import Registry


@dataclass
class ImageDataset:
    train_images: torch.Tensor  # [N, C, H, W] float32, normalised with public constants (images.PUBLIC_STATS)
    train_labels: torch.Tensor  # [N] int64
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    patch_size: int

    @property
    def channels(self) -> int:
        return self.train_images.shape[1]

    @property
    def image_size(self) -> int:
        return self.train_images.shape[-1]


# Every module of this package registers on the first lookup (see dpbench/registry.py).
DATASETS: Registry[Callable[..., ImageDataset]] = Registry("dataset", package=__name__)


def load_dataset(cfg, seed: int) -> ImageDataset:
    """The registered loader of `dataset.name` (a user's builder by import path: the image task
    dispatches to dpbench/data/user.py)."""
    return DATASETS.get(cfg.name)(cfg, seed)

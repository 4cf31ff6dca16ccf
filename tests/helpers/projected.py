"""The projected-Adam family's test kit: fixed-tensor tasks, a tiny ViT and algorithm instances
(DP-GRAPE, naive DP-GaLore, GaLore, DP-Adam, ...) built from a plain options dict."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.models.vit import DPViT
from dpbench.privacy.noise import GaussianNoise
from dpbench.tasks import Task


class TensorTask(Task):
    """Fixed tensors; `weights` scales each example's loss (a huge weight = a huge gradient)."""

    def __init__(self, inputs, labels, weights=None, loss="ce"):
        self.inputs, self.labels = inputs, labels
        self.weights = torch.ones(len(labels)) if weights is None else weights
        self.loss = loss
        self.train_size = len(labels)

    def batch(self, indices):
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[index], self.labels[index], self.weights[index]

    def batch_size(self, batch):
        return int(batch[1].shape[0])

    def per_sample_loss(self, model, batch):
        x, y, w = batch
        out = model(x)
        if self.loss == "ce":
            return w * F.cross_entropy(out, y, reduction="none")
        return w * (out - y).pow(2).reshape(out.shape[0], -1).sum(1)

    def evaluate(self, model):
        return {"accuracy": 0.0}


def algo_cfg(name, **overrides):
    """The algorithm's registered options (its schema's defaults), with small-test settings."""
    from dpbench.algorithms import ALGORITHMS

    base = {}
    if name in ("grape", "galore_naive", "galore"):
        base.update(rank=4, update_interval=3)
    if name == "grape":
        base.update(projection_seed=1234)
    base.update(overrides)
    node = OmegaConf.structured(ALGORITHMS.options(name))
    OmegaConf.set_struct(node, False)  # as composed: options of other algorithms are ignored
    return OmegaConf.merge(node, base)


def privacy(sigma=0.0, clip=1.0, batch=8.0):
    return PrivacySetup(
        noise_multiplier=sigma, clip_norm=clip, expected_batch_size=batch, sample_rate=0.1, noise=GaussianNoise()
    )


def tiny_vit(seed=0):
    torch.manual_seed(seed)
    return DPViT(
        img_size=8, patch_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2,
        mlp_ratio=3.0, global_pool="token",
    )


def image_task(n=12, seed=0, weights=None):
    g = torch.Generator().manual_seed(seed)
    return TensorTask(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g), weights)


def build(name, model, task, lr=1e-2, sigma=0.0, clip=1.0, batch=8.0, **cfg):
    cls = algorithm_class(name)
    return cls(model, task, algo_cfg(name, **cfg), lr, privacy(sigma, clip, batch) if cls.private else None)

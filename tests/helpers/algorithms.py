"""Algorithm instances on a tiny model, and a recorder of the updates they release."""

from __future__ import annotations

import torch
from torch import nn

from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.privacy.noise import GaussianNoise
from dpbench.tasks import build_task
from helpers.config import OFFLINE, compose


def tiny_model(in_features: int = 64, classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, 8), nn.Tanh(), nn.Linear(8, classes))


def build_algorithm(algo: str, *overrides: str, sigma: float = 1.0, clip: float = 1.0, batch: float = 32.0):
    """(algorithm on tiny_model(), its synthetic task, the composed config)."""
    cfg = compose([*OFFLINE, f"algo={algo}", "dataset=synthetic", *overrides])
    task = build_task(cfg, torch.device("cpu"))
    model = tiny_model()
    privacy = PrivacySetup(
        noise_multiplier=sigma, clip_norm=clip, expected_batch_size=batch,
        sample_rate=batch / task.train_size, noise=GaussianNoise("cpu"),
    )
    return algorithm_class(algo)(model, task, cfg.algo, 0.1, privacy), task, cfg


def record_updates(algorithm, apply: bool = False) -> list[list[torch.Tensor]]:
    """Replace apply_update with a recorder of the privatised gradients (optionally still applying)."""
    recorded: list[list[torch.Tensor]] = []
    original = algorithm.apply_update

    def recorder(gradients):
        recorded.append([g.detach().clone() for g in gradients])
        if apply:
            original(gradients)

    algorithm.apply_update = recorder
    return recorded


def sub_weibull_subspace(dim: int, k: int, theta: float, generator: torch.Generator) -> torch.Tensor:
    """One dense [dim, k] draw of DC-DPSGD's `SubWeibullSubspaces` (a new tensor)."""
    from dpbench.algorithms.dcdpsgd_subspaces import SubWeibullSubspaces

    return SubWeibullSubspaces(dim, k, theta, generator).draw().dense()

"""Noise and sampling randomness that no seed and no data can reproduce.

The experiment seed fixes model initialisation and the data split so runs are comparable; the
privacy noise and the Poisson sample selection must stay secret from an adversary who knows the
seed, so they come from generators seeded with fresh OS entropy at construction (never from the
global RNG). This is Opacus's default non-secure mode: torch's Mersenne Twister is not a
cryptographic generator; `privacy.secure_rng=true` draws the noise from the OS CSPRNG instead
(slower, for deployments rather than benchmarks).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch


def entropy_seed() -> int:
    return secrets.randbits(63)


class GaussianNoise:
    """Draws N(0, std^2) tensors. One instance per run; never reseeded."""

    def __init__(self, device: torch.device | str = "cpu", secure: bool = False):
        self.device = torch.device(device)
        self.secure = secure
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(entropy_seed())

    def sample(self, shape: torch.Size | tuple[int, ...], std: float, dtype=torch.float32) -> torch.Tensor:
        if std == 0:
            return torch.zeros(shape, device=self.device, dtype=dtype)
        if self.secure:
            # numpy's Generator on a SeedSequence of 256 fresh OS-entropy bits per draw: no state
            # survives between draws, so no earlier output predicts a later one.
            rng = np.random.default_rng(secrets.randbits(256))
            values = rng.standard_normal(size=tuple(shape), dtype=np.float32)
            return torch.from_numpy(values).to(device=self.device, dtype=dtype) * std
        noise = torch.randn(shape, generator=self.generator, device=self.device, dtype=torch.float32)
        return (noise * std).to(dtype)

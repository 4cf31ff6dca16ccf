"""Noise and sampling randomness that no seed and no data can reproduce.

The experiment seed fixes model initialisation and the data split so runs are comparable; the
privacy noise and the Poisson sample selection must stay secret from an adversary who knows the
seed, so they come from generators seeded with fresh OS entropy at construction (never from the
global RNG). This is Opacus's default non-secure mode: torch's Mersenne Twister is not a
cryptographic generator; `privacy.secure_rng=true` draws the noise from the OS CSPRNG instead
(slower, for deployments rather than benchmarks).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import torch


WIDE = (torch.float32, torch.float64)  # a standard normal narrower than fp32 keeps its grid after scaling


def entropy_seed() -> int:
    return secrets.randbits(63)


class GaussianNoise:
    """Draws N(0, std^2) tensors. One instance per run; never reseeded.

    The standard normal itself is drawn in fp32 or wider (`draw_dtype`, asserted at every draw): a
    bf16 normal scaled by sigma C in fp32 has the right std, but release / std lies on bf16's grid."""

    draw_dtype = torch.float32  # the standard normal's dtype (torch's normal_ draws into it)

    def __init__(self, device: torch.device | str = "cpu", secure: bool = False):
        self.device = torch.device(device)
        self.secure = secure
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(entropy_seed())

    def sample(self, shape: torch.Size | tuple[int, ...], std: float, dtype=torch.float32) -> torch.Tensor:
        if std == 0:
            return torch.zeros(shape, device=self.device, dtype=dtype)
        if self.secure:
            values = _wide(torch.from_numpy(secure_standard_normal(int(np.prod(shape))).reshape(tuple(shape))))
            return (values * std).to(device=self.device, dtype=dtype)
        noise = _wide(torch.empty(shape, device=self.device, dtype=self.draw_dtype))
        return noise.normal_(0.0, std, generator=self.generator).to(dtype)  # scaled as drawn: one pass


def _wide(normal: torch.Tensor) -> torch.Tensor:
    """`normal` (the buffer the standard normal is drawn into), refused unless fp32 or wider."""
    if normal.dtype not in WIDE:
        raise RuntimeError(f"the privacy noise's standard normal must be drawn in fp32 or wider, got {normal.dtype} "
                           "(scaled by sigma C it keeps the narrow grid); this is a bug, please report it")
    return normal


def secure_standard_normal(count: int) -> np.ndarray:
    """N(0, 1) samples from the OS CSPRNG (os.urandom) by Box-Muller, in float64.

    As in Opacus's secure mode, each sample is the sum of four independent normals divided by
    two, which blurs the floating-point artefacts of a single Gaussian draw (Mironov 2012).
    torch offers no CSPRNG-backed sampler without the unmaintained torchcsprng, hence by hand.
    """
    bits = np.frombuffer(os.urandom(8 * 8 * count), dtype=np.uint64).reshape(4, 2, count)
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53  # (0, 1]
    normals = np.sqrt(-2.0 * np.log(uniform[:, 0])) * np.cos(2.0 * np.pi * uniform[:, 1])
    return (normals.sum(axis=0) / 2.0).astype(np.float32)

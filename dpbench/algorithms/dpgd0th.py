"""DPGD-0th (DPZero paper, Algorithm 1): DP-GD on zeroth-order gradient estimates, with
d-dimensional noise -- the baseline whose error grows with the dimension d.

One step, for a logical batch read in physical chunks (the paper's is the full dataset: run it
with train.batch_size = n, sample rate 1):
  z      = public direction (DPZero's: seeded generator; gaussian or sphere of radius sqrt(d))
  s_i    = (l_i(theta + lam z) - l_i(theta - lam z)) / (2 lam)
  g_i    = s_i z, clipped in L2 to C:  g_i * min(1, C / (|s_i| ||z||))
  g      = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I_d)) / B             d-dimensional noise
  theta <- theta - lr * g

Privacy: each example contributes a d-vector of L2 norm <= C, so the sum has sensitivity C
(add/remove); one subsampled Gaussian mechanism with multiplier sigma per step. Noise comes from
`PrivacySetup.noise`. Because every g_i is parallel to z, the clipped sum is (sum_i c_i s_i) z with
c_i = min(1, C / (|s_i| ||z||)): the per-example vectors are never materialised, only the noise
is d-dimensional (one parameter-sized tensor at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpbench.algorithms.learning_rates import lr_scale
from dpbench.algorithms.base import ALGORITHMS, ReleasePart, StepResult
from dpbench.algorithms.dpzero import Direction, ZerothOrderAlgorithm, ZerothOrderOptions
from dpbench.privacy.mechanisms import GaussianMechanism
from dpbench.tasks import Batch


@dataclass
class DPGD0thOptions(ZerothOrderOptions):
    name: str = "dpgd0th"
    smoothing: float = 1.0e-4
    direction: Direction = Direction.sphere


@ALGORITHMS.register("dpgd0th", options=DPGD0thOptions)
class DPGDZerothOrder(ZerothOrderAlgorithm):
    # its error grows with d / (n eps): on the default job d (4,746 in lora mode) exceeds n (1,437), so
    # no setting tried learns it (docs/running.md: Defaults)
    learns_default_job = False

    @classmethod
    def planned_mechanisms(cls, cfg, noise_multiplier, sample_rate, step, clip_norm):
        return [GaussianMechanism(noise_multiplier, sample_rate)]  # one d-dimensional release, sensitivity C

    def direction_norm(self, seed: int, scale: float) -> float:
        """||z||: sqrt(d) on the sphere, the draw's norm for gaussian directions (one extra pass)."""
        if self.direction == "sphere":
            return math.sqrt(self.dimension)
        # one host sync, not one per parameter
        return scale * math.sqrt(float(torch.stack([self.direction_part(p, seed).double().pow(2).sum() for p in self.params]).sum()))

    def clipped_coefficient_sum(self, batches: list[Batch], seed: int, scale: float):
        """sum_i c_i s_i, where c_i s_i z = clip_C(s_i z); the mean loss; the realised size."""
        clip = self.privacy.clip_norm / self.direction_norm(seed, scale)  # |s_i| bound that ||s_i z|| <= C means
        return self.estimate(batches, seed, scale, clip=clip)

    def privatize(self, coefficient_sum: float, seed: int, scale: float) -> list[torch.Tensor]:
        """The step's release, per parameter: ((sum_i c_i s_i) z_p + N(0, (sigma C)^2 I)) / B.
        Sensitivity C (each clip_C(s_i z) has L2 norm <= C), noise multiplier sigma."""
        privacy = self.privacy
        sums = [self.direction_part(p, seed).mul_(scale * coefficient_sum) for p in self.params]
        (noisy,) = self.gaussian_release(
            "gradient", ReleasePart(sums, privacy.clip_norm, privacy.noise_multiplier * privacy.clip_norm)
        )
        return [s / privacy.expected_batch_size for s in noisy]

    def apply_gradient(self, gradients: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, gradients):
                if self.weight_decay and p.ndim >= 2:
                    g = g.add(p.float(), alpha=self.weight_decay)
                lr = self.lr * lr_scale(p)  # train.head_lr_scale (learning_rates.py)
                if p.dtype == torch.float32:
                    p.sub_(g, alpha=lr)
                else:  # half-precision weights: update in fp32, then cast
                    p.copy_(p.float().sub_(g, alpha=lr))

    def step(self, batches: list[Batch], step_index: int) -> StepResult:
        seed = self.next_seed()
        scale = self.direction_scale(seed)
        coefficient_sum, loss, count = self.clipped_coefficient_sum(batches, seed, scale)
        self.apply_gradient(self.privatize(coefficient_sum, seed, scale))  # an empty batch releases pure noise
        return StepResult(loss, count)

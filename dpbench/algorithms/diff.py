"""DIFF: the strawman of the DPDR paper (Liu et al. 2024, Sec. 4.1, Eq. 1), a Table 1 baseline.

Each step privatises every example's difference from the previous *noisy* gradient:
    g~_t = g~_{t-1} + ( sum_i clip_{C_d}(g_t(x_i) - g~_{t-1}) + N(0, sigma^2 C_d^2 I) ) / B
(Eq. 1 prints the noise outside the 1/B; as in DP-SGD it belongs inside.) Then SGD on g~_t.
Step 0 has no previous noisy gradient: it is DP-SGD (C_g = privacy.clip_norm, privacy.clipping).

Privacy: g~_{t-1} is an earlier release (public, post-processing), so the only data-dependent
quantity is the sum of the per-example differences; the difference itself is clipped to C_d,
so adding or removing one example moves the sum by at most C_d: sensitivity C_d, noise std
sigma * C_d, one subsampled Gaussian mechanism with multiplier sigma per step (step 0 likewise
with C_g). Both releases of the run use the calibrated sigma, so the ledger is DP-SGD's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.learning_rates import lr_groups
from dpbench.algorithms.base import ALGORITHMS, LossTally, ReleasePart, StepResult, tensor_bytes
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import GaussianMechanism
from dpbench.privacy.clipping import clipped_sum, per_sample_norms
from dpbench.privacy.engines import PER_EXAMPLE_GRADIENTS
from dpbench.options import AlgoOptions, LrFamily


@dataclass
class DiffOptions(AlgoOptions):
    name: str = "diff"
    default_lr: float = 0.3  # conf/algo/diff.yaml says where it comes from
    lr_family: LrFamily = LrFamily.sgd
    difference_clip: float = 0.1
    momentum: float = 0.0


class GradientDifferenceAlgorithm(DPFirstOrderAlgorithm):
    """Shared by DIFF and DIFF2: releases of clipped per-example *differences* (bound C_d)."""

    engine_capabilities = frozenset({PER_EXAMPLE_GRADIENTS})  # differences of per-example gradients

    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(model, task, cfg, lr, privacy)
        self.difference_clip = cfg.difference_clip
        if not self.difference_clip > 0:
            raise UserError(f"algo.difference_clip (C_d) must be positive, got {cfg.difference_clip}")

    @classmethod
    def planned_mechanisms(cls, cfg, noise_multiplier, sample_rate, step, clip_norm):
        # every step releases one sum, of clipped gradients (C_g) or of clipped differences (C_d),
        # with noise std sigma * its own bound: one subsampled Gaussian with multiplier sigma
        return [GaussianMechanism(noise_multiplier, sample_rate)]

    def build_optimizer(self, params):
        return torch.optim.SGD(lr_groups(params, self.lr), lr=self.lr, momentum=self.cfg.momentum)

    def clipped_difference(self, differences: list[torch.Tensor]) -> list[torch.Tensor]:
        """sum_i clip_{C_d}(d_i) over one physical chunk; d_i flat-clipped over all tensors (a
        non-finite d_i is dropped and counted)."""
        self.engine.meter(tensor_bytes(differences))
        return clipped_sum(differences, self.example_factors(per_sample_norms(differences), self.difference_clip))

    def privatize_difference(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The noisy release of a step: (sum of clipped differences + N(0, (sigma C_d)^2 I)) / B.
        Sensitivity C_d (add/remove one example), noise multiplier sigma."""
        std = self.privacy.noise_multiplier * self.difference_clip
        (noisy,) = self.gaussian_release("gradient_difference", ReleasePart(sums, self.difference_clip, std))
        return [s / self.privacy.expected_batch_size for s in noisy]

    def difference_sums(self, batches) -> tuple[list[torch.Tensor], LossTally]:
        """sum_i clip_{C_d}(d_i) over the logical batch, with d_i from `per_example_differences`."""
        sums, tally = self.zero_sums(), LossTally()
        for batch, losses in self.chunks(batches, tally):
            for s, c in zip(sums, self.clipped_difference(self.per_example_differences(batch, losses))):
                s.add_(c)
        return sums, tally

    def per_example_differences(self, batch, losses) -> list[torch.Tensor]:
        """[B, ...] per-example differences of one physical chunk (losses at theta_t given)."""
        raise NotImplementedError

    def extra_results(self) -> dict:
        return {"difference_clip": self.difference_clip, "sigma": self.privacy.noise_multiplier}


@ALGORITHMS.register("diff", options=DiffOptions)
class DIFF(GradientDifferenceAlgorithm):
    checkpoint_attributes = ("previous",)
    release_carries_state = True  # the next step's differences are from g~_{t-1}, this step's noisy release
    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(model, task, cfg, lr, privacy)
        self.previous: list[torch.Tensor] | None = None  # g~_{t-1} (fp32), public

    def per_example_differences(self, batch, losses):
        """g_t(x_i) - g~_{t-1}: each example's gradient minus the previous noisy gradient."""
        per_sample = self.engine.backward_per_sample(losses)
        return [g.float().sub_(previous) for g, previous in zip(per_sample, self.previous)]

    def step(self, batches, step_index: int) -> StepResult:
        if self.previous is None:  # step 0: DP-SGD with C_g
            sums, tally = self.clip_and_accumulate(batches)
            gradients = self.privatize(sums)
        else:
            sums, tally = self.difference_sums(batches)
            gradients = [previous + noisy for previous, noisy in zip(self.previous, self.privatize_difference(sums))]
        self.previous = [g.detach().float().clone() for g in gradients]
        self.apply_update(gradients)
        return tally.result()

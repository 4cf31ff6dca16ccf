"""DIFF2 (Murata & Suzuki, ICML 2023), single-machine form: a DPDR Table 1 baseline.

A gradient estimate v is rebuilt from a full DP-SGD release every `restart_interval` steps and
otherwise updated by privatised per-example gradient *differences* on the step's batch:
    restart (t % R == 0):  v_t = ( sum_i clip_{C_g}(grad l(theta_t; x_i)) + N(0, sigma^2 C_g^2 I) ) / B
    otherwise:             v_t = v_{t-1} + ( sum_i clip_{C_d}(grad l(theta_t; x_i) - grad l(theta_{t-1}; x_i))
                                             + N(0, sigma^2 C_d^2 I) ) / B
    theta_{t+1} = theta_t - lr * v_t                                   (DIFF2-GD's update)
Both gradients of a difference are of the SAME example (the step's sampled batch) at two
parameter points, so the difference itself is clipped to C_d: adding or removing one example
moves the sum by at most C_d (clipping the two gradients separately would give 2 C_g instead).
theta_{t-1} and v_{t-1} are earlier outputs (post-processing). One subsampled Gaussian mechanism
with multiplier sigma per step, whichever branch: the ledger is DP-SGD's.

Costs: two per-sample backward passes per difference step and one copy of the parameters.
With dropout the two passes draw different masks (the models used here have none).
What was assumed is stated in conf/algo/diff2.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.base import ALGORITHMS, StepResult, tensor_bytes
from dpbench.algorithms.diff import DiffOptions, GradientDifferenceAlgorithm
from dpbench.errors import UserError


@dataclass
class Diff2Options(DiffOptions):
    name: str = "diff2"
    default_lr: float = 1.0  # conf/algo/diff2.yaml says where it comes from
    restart_interval: int = 5  # 20 let the accumulated noise blow up at the default job's end


@ALGORITHMS.register("diff2", options=Diff2Options)
class DIFF2(GradientDifferenceAlgorithm):
    checkpoint_attributes = ("estimate", "previous_params")
    release_carries_state = True  # v_{t-1} (a sum of releases) and theta_{t-1} are read by the next step
    def __init__(self, model, task, cfg, lr, privacy):
        super().__init__(model, task, cfg, lr, privacy)
        self.restart_interval = cfg.restart_interval
        if self.restart_interval < 1:
            raise UserError(f"algo.restart_interval must be >= 1, got {cfg.restart_interval} (1 = plain DP-SGD)")
        self.estimate: list[torch.Tensor] | None = None  # v_{t-1}, fp32
        self.previous_params: list[torch.Tensor] | None = None  # theta_{t-1}

    @classmethod
    def forward_equivalents_per_example(cls, cfg, chunks: int) -> float:
        """A restart step is DP-SGD's; every other step also forms each example's gradient at
        theta_{t-1} (a second forward and backward): averaged over restart_interval steps."""
        one, every = super().forward_equivalents_per_example(cfg, chunks), max(1, int(cfg.restart_interval))
        return one * (2 * every - 1) / every

    def is_restart(self, step_index: int) -> bool:
        return step_index % self.restart_interval == 0

    def per_sample_at(self, losses_fn, params_data: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Per-example gradients of the chunk at theta (None) or at the given parameter values."""
        if params_data is None:
            return self.engine.backward_per_sample(losses_fn())
        current = [p.data for p in self.params]
        try:
            for p, old in zip(self.params, params_data):
                p.data = old
            return self.engine.backward_per_sample(losses_fn())
        finally:
            for p, data in zip(self.params, current):
                p.data = data

    def per_example_differences(self, batch, losses):
        """g_i(theta_t) - g_i(theta_{t-1}): the same example's gradient at two parameter points."""
        now = self.engine.backward_per_sample(losses)
        before = self.per_sample_at(lambda: self.per_example_losses(batch), self.previous_params)
        self.engine.meter(tensor_bytes(now) + tensor_bytes(before))  # both sets exist until subtracted
        return [a.float().sub_(b.float()) for a, b in zip(now, before)]

    def step(self, batches, step_index: int) -> StepResult:
        if self.is_restart(step_index):
            sums, tally = self.clip_and_accumulate(batches)
            estimate = self.privatize(sums)  # sensitivity C_g, multiplier sigma
        else:
            sums, tally = self.difference_sums(batches)
            estimate = [v + d for v, d in zip(self.estimate, self.privatize_difference(sums))]
        self.estimate = [v.detach().float().clone() for v in estimate]
        if self.restart_interval > 1:  # theta_t is needed at the next (difference) step
            if self.previous_params is None:
                self.previous_params = [p.detach().clone() for p in self.params]
            else:
                for old, p in zip(self.previous_params, self.params):
                    old.copy_(p.detach())
        self.apply_update(estimate)
        return tally.result()

    def extra_results(self) -> dict:
        return {**super().extra_results(), "restart_interval": self.restart_interval}

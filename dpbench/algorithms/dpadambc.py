"""DP-AdamBC (Tang et al. 2024, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias
Correction)"): DP-Adam whose second moment is corrected for the variance of the privacy noise.

DP-Adam's noisy gradient g~ = (clipped sum + N(0, σ²C²)) / B carries noise of variance
Φ = (σC / B)² per coordinate, which dominates Adam's second moment v at small batch sizes and turns
the update into a rescaled DP-SGD. DP-AdamBC subtracts it:

    m_t = β1 m + (1 - β1) g~,    v_t = β2 v + (1 - β2) g~²,    m̂ = m_t / (1 - β1^t),   v̂ = v_t / (1 - β2^t)
    θ  -= lr m̂ / sqrt(max(v̂ - Φ, γ′))

with B = qn the public expected batch size (never the realised one, which is private) and σC the
release's noise std; γ′ (algo.gamma) floors the corrected moment in place of Adam's ε.

Sensitivity: the release is DP-SGD's unchanged: per-example gradients clipped to C, summed,
N(0, σ²C²) once per coordinate, so adding or removing one example moves the clipped sum by at
most C in L2 (2C under replace-one). Φ is computed from public quantities (σ, C, q, n) only, so
the corrected moments are post-processing of the noisy release: ε is DP-Adam's for the same σ, q, T.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from dpbench.algorithms.base import ALGORITHMS, adam_betas
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample
from dpbench.algorithms.learning_rates import lr_groups
from dpbench.options import AlgoOptions


@dataclass
class DPAdamBCOptions(AlgoOptions):
    name: str = "dpadambc"
    default_lr: float = 3.0e-4  # below DP-Adam's: a floored coordinate steps by m / sqrt(gamma) (conf/algo/dpadambc.yaml)
    betas: List[float] = field(default_factory=adam_betas)
    gamma: float = 1.0e-8  # γ′, the floor of the corrected second moment (the reference code's default)
    weight_decay: float = 0.0
    per_sample: PerSample = PerSample.materialize


class AdamBC(torch.optim.Optimizer):
    """Adam with its bias-corrected second moment reduced by the noise variance and floored:
    lr m̂ / sqrt(max(v̂ - noise_variance, gamma)). Weight decay is added to the gradient, as torch's Adam."""

    def __init__(self, params, lr: float, betas, gamma: float, noise_variance: float, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), gamma=gamma, weight_decay=weight_decay))
        self.noise_variance = float(noise_variance)  # Φ = (σC / B)², public

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0  # a Python int: the bias corrections need no host sync
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                grad = p.grad if not group["weight_decay"] else p.grad.add(p, alpha=group["weight_decay"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                corrected = (v / (1 - beta2 ** t)).sub_(self.noise_variance).clamp_min_(group["gamma"])
                p.addcdiv_(m, corrected.sqrt_(), value=-group["lr"] / (1 - beta1 ** t))


@ALGORITHMS.register("dpadambc", options=DPAdamBCOptions)
class DPAdamBC(DPFirstOrderAlgorithm):
    per_layer_clipping = True  # privacy.clipping=per_layer: each parameter's part of its clipped sum to its own C_l
    def noise_variance(self) -> float:
        """Φ = (σC / B)²: the per-coordinate variance of the noise in the gradient Adam reads, with B the
        public expected batch size qn (scale_grad divides by it)."""
        return (self.gradient_noise_std() / self.privacy.expected_batch_size) ** 2

    def build_optimizer(self, params):
        return AdamBC(lr_groups(params, self.lr), lr=self.lr, betas=self.cfg.betas, gamma=float(self.cfg.gamma),
                      noise_variance=self.noise_variance(), weight_decay=self.cfg.weight_decay)

    def extra_results(self) -> dict:
        return {**super().extra_results(), "noise_variance": self.noise_variance()}

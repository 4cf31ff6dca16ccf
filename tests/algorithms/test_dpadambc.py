"""DP-AdamBC: Adam's second moment corrected by the noise variance (sigma C / B)^2 of the public
expected batch size B, floored at gamma'."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.algorithms import build_algorithm

from dpbench.algorithms.dpadambc import AdamBC

# the engine's backward hooks fire on a first layer whose inputs need no gradient: harmless
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def test_the_update_is_lr_mhat_over_the_root_of_the_corrected_floored_second_moment():
    lr, (b1, b2), gamma, phi = 0.1, (0.9, 0.999), 1e-4, 0.5
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = AdamBC([p], lr=lr, betas=(b1, b2), gamma=gamma, noise_variance=phi)
    grads = [torch.tensor([2.0, 0.1, -3.0]), torch.tensor([1.0, -0.2, -3.0])]
    m, v, expected = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        optimizer.step()
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        expected -= lr * m_hat / torch.clamp(v_hat - phi, min=gamma).sqrt()
        assert torch.allclose(p.detach().double(), expected, rtol=1e-5)
    assert (v / (1 - b2**2) - phi)[1] < gamma < (v / (1 - b2**2) - phi)[0]  # one coordinate floored, one not


def test_the_noise_variance_is_of_the_expected_batch_size_not_the_realised_one():
    algorithm, task, _ = build_algorithm("dpadambc", "algo.gamma=1e-6", sigma=2.0, clip=0.5, batch=32.0)
    assert math.isclose(algorithm.optimizer.noise_variance, (2.0 * 0.5 / 32.0) ** 2)
    assert algorithm.optimizer.param_groups[0]["gamma"] == 1e-6
    algorithm.train_step([task.batch(range(5))], 0)  # a realised batch of 5 changes nothing public
    assert math.isclose(algorithm.optimizer.noise_variance, (2.0 * 0.5 / 32.0) ** 2)

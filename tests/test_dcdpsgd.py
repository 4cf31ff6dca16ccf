"""DC-DPSGD: score and gradient sensitivity, gradient noise, exact top-p, accounting."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from helpers.algorithms import build_algorithm, record_updates, sub_weibull_subspace
from helpers.config import OFFLINE, compose

from dpbench.algorithms import dcdpsgd
from dpbench.algorithms.dcdpsgd import split_noise_multipliers, subspace_scores, tail_mask
from dpbench.privacy.accountants import RDPAccountant, calibrate_noise_multiplier, ledger_of_plan
from dpbench.privacy.clipping import clip_factors, per_sample_norms


def test_subspace_is_orthonormal_and_redrawn():
    generator = torch.Generator().manual_seed(0)
    first = sub_weibull_subspace(300, 20, 2.0, generator)
    second = sub_weibull_subspace(300, 20, 2.0, generator)
    assert first.shape == (300, 20)
    assert torch.allclose(first.T @ first, torch.eye(20), atol=1e-5)
    assert not torch.allclose(first, second)


def test_scores_lie_in_unit_interval_and_each_depends_on_its_own_example_only():
    generator = torch.Generator().manual_seed(1)
    grads = torch.randn(16, 50, generator=generator) * torch.logspace(-6, 6, 16)[:, None]
    grads[3] = 0.0
    basis = sub_weibull_subspace(50, 10, 2.0, generator)
    scores = subspace_scores(grads, basis)
    assert scores.min() >= 0 and scores.max() <= 1 and scores[3] == 0
    # removing example 5 removes one coordinate in [0, 1] and leaves the others as they were:
    # the score vector's L2 sensitivity is at most 1 before noise
    kept = torch.cat([grads[:5], grads[6:]])
    assert torch.allclose(subspace_scores(kept, basis), torch.cat([scores[:5], scores[6:]]), atol=1e-6)
    # the bound holds even for a non-orthonormal basis (the clamp)
    assert subspace_scores(grads, torch.ones(50, 10)).max() <= 1


def _batch(task, n):
    return task.batch(list(range(n)))


def test_gradient_contributions_are_bounded_by_c1_and_c2():
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", clip=0.01)
    c2, c1 = algorithm.body_clip, algorithm.tail_clip
    assert c1 == pytest.approx(10 * c2)
    losses = task.per_sample_loss(algorithm.model, _batch(task, 40))
    per_sample = algorithm.engine.backward_per_sample(losses)
    norms = per_sample_norms(per_sample)
    tail, thresholds = algorithm.clip_thresholds(torch.randn(40))
    contributions = clip_factors(norms, thresholds) * norms
    assert norms.min() > c1  # the bound is active for every example
    assert torch.all(contributions[tail] <= c1 * (1 + 1e-5)) and torch.all(contributions[~tail] <= c2 * (1 + 1e-5))
    assert tail.sum() == 4


def test_removing_one_example_moves_the_clipped_sum_by_at_most_2c1_minus_c2():
    """With the noise at 0 (so the tail set is the exact top-p), removing any one example changes
    the released sum by at most c1 + (c1 - c2): its own clipped gradient plus at most one other
    example crossing the tail boundary (the rank_coupled sensitivity)."""
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_fraction=0.2", "algo.tail_selection=rank",
                                         clip=0.05, batch=1.0)
    algorithm.sigma_tr = algorithm.sigma_dp = 0.0
    recorded = record_updates(algorithm)
    images, labels = _batch(task, 12)
    algorithm.projection_generator.manual_seed(7)
    algorithm.train_step([(images, labels)], 0)
    full = torch.cat([g.flatten() for g in recorded[-1]])
    worst = 0.0
    for drop in range(12):
        keep = [i for i in range(12) if i != drop]
        algorithm.projection_generator.manual_seed(7)  # same public subspace
        algorithm.train_step([(images[keep], labels[keep])], 0)
        worst = max(worst, (full - torch.cat([g.flatten() for g in recorded[-1]])).norm().item())
    c1, c2 = algorithm.tail_clip, algorithm.body_clip
    assert c2 < worst <= (2 * c1 - c2) * (1 + 1e-4)


def test_gradient_noise_has_std_sigma_dp_c1_over_b():
    algorithm, _, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", sigma=0.8, clip=0.1, batch=32.0)
    noisy = algorithm.privatize([torch.zeros(200_000)])[0]
    expected = split_noise_multipliers(0.8, 0.5)[1] * 1.0 / 32.0  # sigma_dp * c1 / B, c1 = 10 * 0.1
    assert noisy.mean().abs() < 4 * expected / math.sqrt(200_000)
    assert noisy.std().item() == pytest.approx(expected, rel=0.01)


def test_zero_score_noise_selects_the_exact_top_p(monkeypatch):
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=16", "algo.tail_fraction=0.2", "algo.tail_selection=rank")
    algorithm.sigma_tr = 0.0
    basis = sub_weibull_subspace(sum(p.numel() for p in algorithm.params), 16, 2.0, torch.Generator().manual_seed(3))
    monkeypatch.setattr(algorithm.subspaces, "draw", lambda: basis)
    record_updates(algorithm)
    images, labels = _batch(task, 30)
    # two physical batches: the two-pass path
    algorithm.train_step([(images[:17], labels[:17]), (images[17:], labels[17:])], 0)
    # independent scores: one autograd gradient per example
    exact = []
    for i in range(30):
        algorithm.model.zero_grad()
        loss = torch.nn.functional.cross_entropy(algorithm.model(images[i : i + 1]), labels[i : i + 1])
        grads = torch.autograd.grad(loss, algorithm.params)
        flat = torch.cat([g.flatten() for g in grads])
        exact.append(((flat / flat.norm()) @ basis).pow(2).sum())
    expected = torch.zeros(30, dtype=torch.bool)
    expected[torch.topk(torch.stack(exact), 6).indices] = True
    assert torch.equal(algorithm.last_tail, expected)


def test_tail_mask_counts():
    assert tail_mask(torch.arange(10.0), 0.1).nonzero().flatten().tolist() == [9]
    assert tail_mask(torch.arange(3.0), 0.1).sum() == 0


def _dp_accounting_epsilon(events, delta):
    accountant = dpa.rdp.RdpAccountant()
    for sigma, q, count in events:
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("selection", ["threshold", "rank"])
@pytest.mark.parametrize("sigma,fraction,steps", [(0.8, 0.5, 200), (1.5, 0.2, 1000)])
def test_a_step_is_one_joint_mechanism_checked_against_dp_accounting(sigma, fraction, steps, selection):
    """Histogram (or scores) and gradient read one Poisson batch: ONE subsampled Gaussian per step at
    the whitened pair's multiplier, never two independently subsampled ones (which understates epsilon)."""
    cfg = compose([*OFFLINE, "algo=dcdpsgd", f"algo.score_budget_fraction={fraction}",
                   f"algo.tail_selection={selection}"]).algo
    q = 0.01
    ledger = ledger_of_plan(lambda step: dcdpsgd.DCDPSGD.planned_mechanisms(cfg, sigma, q, step, 1.0), steps)
    sigma_tr, sigma_dp = sigma / math.sqrt(fraction), sigma / math.sqrt(1 - fraction)
    ratio = cfg.tail_clip_ratio  # c1/c2; rank_coupled charges 2 c1 - c2 on noise sigma_dp c1
    sigma_grad = sigma_dp if selection == "threshold" else sigma_dp * ratio / (2 * ratio - 1)
    joint = (sigma_tr**-2 + sigma_grad**-2) ** -0.5
    (record,) = ledger.as_records()
    assert record["count"] == steps and record["noise_multiplier"] == pytest.approx(joint, rel=1e-12)
    if selection == "threshold":
        assert joint == pytest.approx(sigma, rel=1e-12)  # a step costs DP-SGD at the base sigma
    ours = RDPAccountant().epsilon(ledger, 1e-5)
    # the joint release as dp-accounting composes it: one Poisson-sampled event of two Gaussians
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(joint)), steps)
    assert ours == pytest.approx(accountant.get_epsilon(1e-5), rel=0.03)
    separate = _dp_accounting_epsilon([(sigma_tr, q, steps), (sigma_grad, q, steps)], 1e-5)
    assert ours > separate * 1.05  # the old, unsound charge was smaller


def test_calibration_meets_the_target_and_rank_coupled_costs_more():
    q, steps = 0.02, 300
    results = {}
    for mode in ("tail_clip", "rank_coupled"):
        cfg = compose([*OFFLINE, "algo=dcdpsgd", "algo.tail_selection=rank", f"algo.gradient_sensitivity={mode}"]).algo

        def ledger_for(sigma, cfg=cfg):
            return ledger_of_plan(lambda step: dcdpsgd.DCDPSGD.planned_mechanisms(cfg, sigma, q, step, 1.0), steps)

        sigma = calibrate_noise_multiplier(RDPAccountant(), ledger_for, 4.0, 1e-5)
        assert 3.95 <= RDPAccountant().epsilon(ledger_for(sigma), 1e-5) <= 4.0
        results[mode] = sigma
    assert results["rank_coupled"] > results["tail_clip"]


def test_k_none_scores_every_nonzero_gradient_one_and_runs_end_to_end(tmp_path):
    from helpers.config import TINY, compose

    from dpbench.run import run_job

    grads = torch.randn(6, 40)
    grads[2] = 0.0
    assert subspace_scores(grads, None).tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    algorithm, _, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=null")
    assert algorithm.subspaces is None
    results = run_job(compose(TINY + ["algo=dcdpsgd", "algo.subspace_dim=null"]), tmp_path, show_progress=False)
    assert results.status == "completed" and 7.5 < results.privacy.epsilon <= 8.0

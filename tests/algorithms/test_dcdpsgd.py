"""DC-DPSGD: score and gradient sensitivity, gradient noise, exact top-p, accounting.

DC-DPSGD threshold selection (algo.tail_selection=threshold): sensitivity c1 against an
adversarial neighbour, where rank selection moves the release by more than c1.

DC-DPSGD's score subspace: drawn on the model's device once per step, and built in blocks of
rows when d_id x k is too large to hold (every point of the preset grids runs)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from helpers.algorithms import build_algorithm, record_updates, sub_weibull_subspace
from helpers.config import OFFLINE, compose

from dpbench.algorithms import dcdpsgd
from dpbench.algorithms.dcdpsgd import split_noise_multipliers
from dpbench.algorithms.dcdpsgd_tail import SCORE_BIN_EDGES, histogram_threshold, score_histogram, tail_mask
from dpbench.algorithms.dcdpsgd_subspaces import (
    MAX_HELD_ELEMENTS, MAX_PROJECTION_ELEMENTS, BlockBasis, SubWeibullSubspaces, subspace_scores,
)
from dpbench.runtime.algorithm_state import algorithm_state, load_algorithm_state
from dpbench.privacy.accountants import (
    RDPAccountant,
    calibrate_noise_multiplier,
    ledger_of_plan,
)
from dpbench.algorithms.base import LossTally
from dpbench.privacy.clipping import clip_factors, clipped_sum, per_sample_norms
from dpbench.run import setup


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
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_clip_ratio=10", clip=0.01)
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
    algorithm, _, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_clip_ratio=10", sigma=0.8, clip=0.1, batch=32.0)
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


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
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


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
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


def _released_sum(algorithm, images, labels, recorded):
    algorithm.projection_generator.manual_seed(7)  # the same public subspace in both neighbours
    algorithm.train_step([(images, labels)], 1)
    return torch.cat([g.flatten() for g in recorded[-1]])


def _worst_added_example_change(selection: str) -> tuple[float, float, int]:
    """Noise off; a batch of 12, then the same batch plus one example whose input is scaled by 1e4
    (a huge gradient, hence clipped to whatever its threshold is). Over every candidate
    neighbour: the largest change of the (pre-noise) gradient release, c1, and how often the
    added example was tail. Threshold selection uses a public threshold at the base batch's
    median score (as a past step could set it), so both sides of it are populated."""
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_fraction=0.25",
                                         f"algo.tail_selection={selection}", clip=0.05, batch=1.0)
    algorithm.sigma_tr = algorithm.sigma_dp = 0.0
    recorded = record_updates(algorithm)
    images, labels = task.batch(list(range(40)))
    base_images, base_labels = images[:12], labels[:12]
    seen = []
    score = algorithm.example_scores
    algorithm.example_scores = lambda per_sample, basis: seen.append(score(per_sample, basis)) or seen[-1]
    before = _released_sum(algorithm, base_images, base_labels, recorded)
    tau = seen[-1].median().item()
    algorithm.current_threshold = lambda: tau
    before = _released_sum(algorithm, base_images, base_labels, recorded)
    assert 0 < int(algorithm.last_tail.sum()) < 12 or selection == "rank"
    worst, added_tail = 0.0, 0
    for extra in range(12, 40):
        added_images = torch.cat([base_images, 1e4 * images[extra : extra + 1]])  # large gradient
        added_labels = torch.cat([base_labels, labels[extra : extra + 1]])
        after = _released_sum(algorithm, added_images, added_labels, recorded)
        added_tail += int(algorithm.last_tail[-1])
        worst = max(worst, (after - before).norm().item())
    return worst, algorithm.tail_clip, added_tail


def test_threshold_selection_moves_the_gradient_release_by_at_most_c1():
    worst, c1, added_tail = _worst_added_example_change("threshold")
    assert added_tail > 0  # the added example did take the large threshold c1
    assert 0 < worst <= c1 * 1.0001


def test_rank_selection_can_move_it_by_more_than_c1():
    worst, c1, _ = _worst_added_example_change("rank")
    assert worst > c1 * 1.0001  # the added example takes the tail from another one


def test_threshold_is_the_top_p_point_of_the_histogram():
    scores = torch.logspace(-5, -0.01, 1000)
    threshold = histogram_threshold(score_histogram(scores), 0.1)
    assert (scores > threshold).float().mean().item() == pytest.approx(0.1, abs=0.03)
    assert histogram_threshold(torch.zeros(len(SCORE_BIN_EDGES) - 1), 0.1) == math.inf
    assert score_histogram(torch.tensor([0.0, 1.0, 1.0])).sum() == 3  # the endpoints are counted


def test_threshold_selection_releases_a_histogram_of_sensitivity_1_and_plans_c1():
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_selection=threshold",
                                         sigma=1.0, clip=0.1, batch=16.0)
    releases = []
    algorithm.release_observer = lambda name, parts, noisy, mechanism: releases.append((name, parts, mechanism))
    record_updates(algorithm)
    images, labels = task.batch(list(range(16)))
    algorithm.train_step([(images, labels)], 0)
    assert algorithm.last_tail.sum() == 0  # step 0: no threshold released yet, every example is body
    algorithm.train_step([(images, labels)], 1)
    assert len(releases) == 2  # one release per step: histogram and gradient together
    name, (score_part, grad_part), mechanism = releases[-1]
    assert name == "scores_and_gradient" and score_part.sensitivity == 1.0
    assert score_part.values[0].shape == (len(SCORE_BIN_EDGES) - 1,) and score_part.values[0].sum() == 16
    assert grad_part.sensitivity == pytest.approx(algorithm.tail_clip)
    assert grad_part.noise_std == pytest.approx(algorithm.sigma_dp * algorithm.tail_clip)
    assert score_part.noise_std == pytest.approx(algorithm.sigma_tr)
    assert mechanism.noise_multiplier == pytest.approx(1.0)  # (sigma_tr^-2 + sigma_dp^-2)^-1/2 = base sigma
    cfg = compose([*OFFLINE, "algo=dcdpsgd", "algo.tail_selection=threshold"]).algo
    (planned,) = dcdpsgd.DCDPSGD.planned_mechanisms(cfg, 1.0, 0.01, 0, 0.1)
    assert planned.noise_multiplier == pytest.approx(1.0)  # c1 sensitivity: the pair costs DP-SGD at sigma
    (rank,) = dcdpsgd.DCDPSGD.planned_mechanisms(compose([*OFFLINE, "algo=dcdpsgd", "algo.tail_selection=rank"]).algo, 1.0, 0.01, 0, 0.1)
    assert rank.noise_multiplier < planned.noise_multiplier  # rank selection pays 2 c1 - c2


def test_the_released_histogram_average_survives_a_checkpoint():
    """A resumed run continues with the same public threshold (the histogram average is checkpointed)."""
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_selection=threshold")
    record_updates(algorithm)
    images, labels = task.batch(list(range(16)))
    for step in range(2):
        algorithm.train_step([(images, labels)], step)
    state = algorithm_state(algorithm)
    resumed, _, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_selection=threshold")
    assert resumed.current_threshold() == math.inf
    load_algorithm_state(resumed, state)
    assert resumed.current_threshold() == algorithm.current_threshold() < math.inf


@pytest.mark.parametrize("held", [True, False])
def test_block_basis_is_the_orthonormal_basis_of_the_same_draw(held):
    subspaces = SubWeibullSubspaces(300, 20, 2.0, torch.Generator().manual_seed(0), max_elements=1000,
                                    max_held_elements=6000 if held else 5999)
    # held for the step, or one block of rows held at a time; generated one block at a time either way
    assert subspaces.blocks == 6 and subspaces.basis.shape == (300 if held else 50, 20)
    assert subspaces.signs.shape == (50, 20)
    basis = subspaces.draw()
    assert isinstance(basis, BlockBasis)
    dense = basis.dense()
    assert torch.allclose(dense.T @ dense, torch.eye(20), atol=1e-5)
    raw = torch.cat([subspaces.block(basis.seed, i).clone() for i in range(subspaces.blocks)])
    reference = torch.linalg.qr(raw)[0]  # Householder QR of the whole draw: the same span
    grads = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 16)[:, None]
    scores = subspace_scores(grads, basis)
    assert scores.dtype == torch.float32 and scores.min() >= 0 and scores.max() <= 1
    assert torch.allclose(scores, subspace_scores(grads, reference), atol=1e-5)
    assert not torch.allclose(basis.dense(), subspaces.draw().dense())  # a fresh subspace every draw


def test_dense_basis_scores_are_those_of_the_orthonormal_basis_of_the_same_draw():
    subspaces = SubWeibullSubspaces(300, 20, 2.0, torch.Generator().manual_seed(0))
    basis = subspaces.draw()
    reference = torch.linalg.qr(basis.raw.clone())[0]
    assert torch.allclose(basis.dense().T @ basis.dense(), torch.eye(20), atol=1e-5)
    grads = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 16)[:, None]
    assert torch.allclose(subspace_scores(grads, basis), subspace_scores(grads, reference), atol=1e-5)
    draws = torch.stack([SubWeibullSubspaces(1, 1, 1.0, torch.Generator().manual_seed(i)).draw().raw[0, 0] for i in range(2000)])
    assert abs(draws.mean()) < 0.15 and draws.abs().mean().item() == pytest.approx(1.0, rel=0.1)  # Laplace(0, 1) at theta 1


@pytest.mark.parametrize("theta", [2.0, 1.5])
def test_sub_weibull_entries_are_the_sign_and_inverse_cdf_of_one_uniform(theta):
    drawn = SubWeibullSubspaces(50, 4, theta, torch.Generator().manual_seed(2)).draw().raw
    uniform = torch.rand((50, 4), generator=torch.Generator().manual_seed(2))
    expected = torch.copysign((-torch.log((2 * uniform - 1).abs().clamp_min(1e-12))) ** theta, uniform - 0.5)
    assert torch.allclose(drawn, expected, rtol=1e-6, atol=0)


def test_subspace_and_its_generator_live_on_the_models_device_and_are_drawn_once_per_step(monkeypatch):
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8")
    device = algorithm.params[0].device
    assert algorithm.projection_generator.device == device and algorithm.subspaces.basis.device == device
    draws = []
    draw = algorithm.subspaces.draw
    monkeypatch.setattr(algorithm.subspaces, "draw", lambda: draws.append(1) or draw())
    algorithm.train_step([task.batch(list(range(8))), task.batch(list(range(8, 16)))], 0)  # two physical chunks
    assert len(draws) == 1


@pytest.mark.parametrize("k", [150, 200])
def test_dcdpsgd_t3_points_beyond_the_projection_limit_run(k):
    """cnn5 at 32x32x3 (357k parameters scored) with k = 150 and 200 refused before; now in blocks."""
    cfg = compose(["experiment=dcdpsgd_t3", f"algo.subspace_dim={k}", "dataset=synthetic", "dataset.channels=3",
                   "dataset.image_size=32", "dataset.num_classes=10", "dataset.train_size=64", "dataset.test_size=8",
                   "logger=none", "device=cpu", "train.batch_size=4", "train.steps=2", "privacy.noise_multiplier=1.0",
                   "privacy.epsilon=null", "algo.score_noise_multiplier=1.0"])
    job = setup(cfg)
    algorithm = job.algorithm
    assert algorithm.subspaces.blocks > 1
    assert algorithm.subspaces.signs.numel() <= MAX_PROJECTION_ELEMENTS  # generated a block at a time
    assert algorithm.subspaces.held and algorithm.subspaces.basis.numel() <= MAX_HELD_ELEMENTS  # held for the step
    assert algorithm.extra_results()["score_subspace_blocks"] == algorithm.subspaces.blocks
    if k == 200:  # one step (two physical chunks) of the paper's default k
        result = algorithm.train_step([job.task.batch([0, 1]), job.task.batch([2, 3])], 0)
        assert result.batch_size == 4 and algorithm.last_tail.shape == (4,)


def _two_pass_clip_and_accumulate(algorithm, batches):
    """The step before each block of the subspace was generated once a step: scores of every
    example (pass 1, the blocks regenerated for the Gram and again for every chunk), the tail set,
    then every chunk's per-example gradients recomputed and clipped (pass 2)."""
    basis, tally, scores, finite = algorithm.subspaces.draw(), LossTally(), [], []
    for _, losses in algorithm.chunks(batches, tally):
        per_sample = algorithm.engine.backward_per_sample(losses)
        ident = torch.cat([g.reshape(g.shape[0], -1) for g in per_sample], 1)
        scores.append(subspace_scores(ident, basis))
        finite.append(torch.isfinite(per_sample_norms(per_sample)))
    scores, finite = torch.cat(scores), torch.cat(finite)
    algorithm.recorded_scores = scores
    if algorithm.threshold_selection:
        tail = (scores > algorithm.current_threshold()) & finite
        algorithm.pending_histogram = score_histogram(scores[finite])
    else:
        tail = algorithm.clip_thresholds(algorithm.release_scores(scores[finite]), finite)[0]
    thresholds, sums, start = torch.where(tail, algorithm.tail_clip, algorithm.body_clip), algorithm.zero_sums(), 0
    for batch in batches:
        per_sample = algorithm.engine.backward_per_sample(algorithm.per_example_losses(batch))
        size = per_sample[0].shape[0]
        factors = clip_factors(per_sample_norms(per_sample), thresholds[start : start + size])
        for total, part in zip(sums, clipped_sum(per_sample, factors)):
            total.add_(part)
        start += size
    algorithm.last_tail = tail
    return sums, tally


@pytest.mark.parametrize("selection", ["threshold", "rank"])
def test_blocks_generated_once_a_step_give_the_two_pass_steps_subspace_scores_and_update(selection):
    """The step generates each block of a blocked subspace once (held for the step) and, in
    threshold mode, clips each chunk as it is scored: on the same batch (three physical chunks)
    and generator states, the subspace, the scores and the released update are those of the
    step that regenerated the blocks for every chunk and recomputed the gradients."""
    runs = []
    for fast in (True, False):
        algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", f"algo.tail_selection={selection}",
                                             "algo.tail_fraction=0.25")
        # the tiny model's 556 parameters in 5 blocks of 125 rows (parameter boundaries inside blocks)
        algorithm.subspaces = SubWeibullSubspaces(556, 8, 2.0, algorithm.projection_generator, max_elements=1000,
                                                  max_held_elements=10**9 if fast else 0)
        assert algorithm.subspaces.blocks == 5 and algorithm.subspaces.held == fast
        subspaces, scores, generated = [], [], []
        block = algorithm.subspaces.block
        algorithm.subspaces.block = lambda seed, index, f=block, seen=generated: seen.append(index) or f(seed, index)
        draw = algorithm.subspaces.draw
        algorithm.subspaces.draw = lambda draw=draw, seen=subspaces: seen.append(draw()) or seen[-1]
        example_scores = algorithm.example_scores
        algorithm.example_scores = lambda per_sample, basis, f=example_scores, seen=scores: seen.append(f(per_sample, basis)) or seen[-1]
        if not fast:
            algorithm.clip_and_accumulate = lambda batches, a=algorithm: _two_pass_clip_and_accumulate(a, batches)
        recorded = record_updates(algorithm, apply=True)
        algorithm.current_threshold = lambda: 0.02  # some of the tiny model's scores exceed it, most do not
        for step in range(2):
            algorithm.projection_generator.manual_seed(11 + step)
            algorithm.privacy.noise.generator.manual_seed(5 + step)
            generated.clear()
            algorithm.train_step([task.batch(list(range(i, i + 4))) for i in (0, 4, 8)], step)
            assert generated == list(range(5)) or not fast  # each block once a step (not once per chunk too)
            runs.append((subspaces[-1].dense(), torch.cat(scores) if fast else algorithm.recorded_scores,
                         algorithm.last_tail.clone(), recorded[-1]))
            scores.clear()
    for (basis, scores, tail, update), (slow_basis, slow_scores, slow_tail, slow_update) in zip(runs[:2], runs[2:]):
        assert torch.allclose(basis, slow_basis, atol=1e-5)
        assert torch.allclose(scores, slow_scores, atol=1e-5)
        assert torch.equal(tail, slow_tail) and 0 < int(tail.sum()) < 12  # both thresholds used
        assert all(torch.allclose(g, h, atol=1e-5) for g, h in zip(update, slow_update))


def test_block_subspaces_follow_the_generator_state():
    """The public subspace is reproducible from the checkpointed generator state."""
    first = SubWeibullSubspaces(120, 10, 2.0, torch.Generator().manual_seed(3), max_elements=400)
    state = first.generator.get_state()
    one = first.draw().dense()
    first.generator.set_state(state)
    assert torch.equal(one, first.draw().dense())


def _shapes(value):
    """The structure of a checkpoint entry: tensors by shape and dtype, containers by their keys and lengths."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _shapes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shapes(v) for v in value]
    return type(value).__name__


def test_rank_mode_keeps_the_realised_batch_size_inside_the_step():
    """Rank selection's noisy score vector has the realised batch size as its length, which its
    sensitivity-1 argument does not cover: it must not leave the step. What a run keeps (the
    checkpoint without un-noised statistics, the noisy gradient) has the same shapes for a batch
    of 12 and one of 13; the length reaches only the tail set, whose effect on the gradient is
    covered by the rank_coupled sensitivity (test above)."""
    states, updates = [], []
    for size in (12, 13):
        algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_selection=rank")
        recorded = record_updates(algorithm, apply=True)
        algorithm.train_step([_batch(task, size)], 0)
        states.append(_shapes(algorithm_state(algorithm, log_private_stats=False)))
        updates.append([tuple(g.shape) for g in recorded[-1]])
    assert states[0] == states[1] and updates[0] == updates[1]
    assert "tail_fraction_seen" in algorithm.private_statistics()  # the realised tail fraction: un-noised, withheld

"""DC-DPSGD threshold selection (algo.tail_selection=threshold): sensitivity c1 against an
adversarial neighbour, where rank selection moves the release by more than c1."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.algorithms import build_algorithm, record_updates
from helpers.config import OFFLINE, compose

from dpbench.algorithms import dcdpsgd
from dpbench.algorithms.dcdpsgd import SCORE_BIN_EDGES, histogram_threshold, score_histogram
from dpbench.checkpoint import algorithm_state, load_algorithm_state


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

"""`dpbench algo=X` learns at X's own defaults: each algorithm's config carries its default learning
rate, lr family and clip norm (conf/algo/*.yaml), and a data set may set a rate per family."""

from __future__ import annotations

import pytest
from helpers.config import OFFLINE, compose
from omegaconf import OmegaConf

from dpbench.algorithms import ALGORITHMS, algorithm_class
from dpbench.schema import algo_schemas, default_learning_rate

PRIVATE = sorted(name for name in ALGORITHMS.names() if algorithm_class(name).private)
# Zeroth-order methods fine-tune: one random direction per step does not train the default job's
# 69k-parameter ViT from scratch at any rate tried, MeZO without noise included (docs/running.md).
FROM_SCRATCH = [name for name in PRIVATE if algo_schemas()[name].lr_family != "zeroth_order"]
CHANCE = 0.1  # digits: ten classes, stratified split


def test_a_data_sets_rate_for_the_family_wins_over_the_algorithms_own():
    by_family = OmegaConf.create({"adam": 1e-3, "sgd": 0.3})
    assert default_learning_rate(by_family, "sgd", 2.0) == 0.3
    assert default_learning_rate(by_family, "zeroth_order", 2e-4) == 2e-4  # no entry: the algorithm's
    assert default_learning_rate(5e-4, "sgd", 2.0) == 5e-4  # one rate for every algorithm
    assert default_learning_rate(None, "adam", 2e-2) == 2e-2


def test_every_algorithm_composes_with_its_own_defaults_and_the_command_line_wins():
    for name in ALGORITHMS.names():
        cfg = compose([*OFFLINE, f"algo={name}"])
        assert cfg.train.lr == cfg.algo.default_lr > 0 and cfg.privacy.clip_norm == cfg.algo.default_clip_norm > 0
        assert compose([*OFFLINE, f"algo={name}", "train.lr=0.123", "privacy.clip_norm=4"]).train.lr == 0.123
    sgd_like = compose([*OFFLINE, "algo=dpsgd"])
    assert sgd_like.algo.lr_family == "sgd" and compose([*OFFLINE, "algo=dpzero"]).algo.lr_family == "zeroth_order"


@pytest.mark.slow
@pytest.mark.parametrize("algo", FROM_SCRATCH)
def test_every_private_first_order_algorithm_beats_chance_twice_at_its_defaults(algo, tmp_path):
    """`dpbench algo=X logger=none` on the default task (digits, eps = 8). The noise is drawn fresh
    each run, so the accuracy varies: at the committed defaults every algorithm's lowest of five
    runs was well above the bound (docs/running.md: Defaults), which a run misses far less than once
    in a thousand."""
    from dpbench.run import run_job

    results = run_job(compose([*OFFLINE, f"algo={algo}"]), tmp_path, show_progress=False)
    assert results.status == "completed"
    assert results.metrics.test_accuracy >= 2 * CHANCE, f"{algo}: {results.metrics.test_accuracy:.3f}"

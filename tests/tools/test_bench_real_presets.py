"""The real tier's presets (bench_real, its epsilon-3, engine, calibration, full-model, equal-compute and
tuned companions): every job of every grid their headers run composes to a valid config, on the same
data, steps and batch, with its family's learning rate, and the tuned one sweeps only keys that exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.config import compose_point
from omegaconf import OmegaConf

from dpbench.paths import config_dir
from dpbench.run_config import validate
from dpbench.schema import algo_schemas, register

from test_leaderboard import grid_points, header_grids  # the bench presets' header-grid reader

register()
EXPERIMENTS = Path(config_dir()) / "experiment"
PRESETS = ("bench_real", "bench_real_eps3", "bench_real_engines", "bench_real_calibration", "bench_real_full",
           "bench_real_compute")
PRIVATE = {"dpadam", "dpsgd", "grape", "galore_naive", "dplora", "dpdr", "dcdpsgd", "dpzero"}
PUBLIC = {"adam", "lora", "galore", "mezo"}


def jobs_of(name: str) -> list[dict]:
    bases, jobs = {}, []
    for grid in header_grids(name):
        points, _ = grid_points(grid, product=True)
        for point in points:
            cfg = compose_point(point, bases)
            assert OmegaConf.get_type(cfg.algo) is algo_schemas()[cfg.algo.name]
            validate(cfg, grid=True)
            jobs.append(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    return jobs


@pytest.mark.slow  # composes every job of every grid: the slow tier, as the other bench presets
@pytest.mark.parametrize("name", PRESETS)
def test_every_job_of_the_real_presets_composes_on_one_task(name):
    jobs = jobs_of(name)
    assert jobs, "a preset's header runs at least one grid"
    assert {(j["dataset"]["name"], j["model"]["name"]) for j in jobs} == {("rt_snippets", "minilm")}
    for key in (("train", "batch_size"), ("train", "epochs"), ("train", "steps"), ("train", "head_lr_scale"),
                ("privacy", "delta"), ("privacy", "clip_norm")):
        assert len({j[key[0]][key[1]] for j in jobs}) == 1, f"{key} differs between jobs of {name}"
    if name == "bench_real":
        assert {j["algo"]["name"] for j in jobs} == PRIVATE | PUBLIC  # every method, ceilings included
        assert {j["model"]["trained_blocks"] for j in jobs} == {0, 2}  # the linear probe's second grid
        assert len({j["seed"] for j in jobs}) == 3 and {j["privacy"]["epsilon"] for j in jobs} == {8.0}
    if name == "bench_real_full":  # the whole encoder, one seed: Adam, DP-GRAPE and DP-Adam (book-keeping)
        assert {j["model"]["trained_blocks"] for j in jobs} == {None} and {j["seed"] for j in jobs} == {0}
        assert {(j["algo"]["name"], j["algo"].get("per_sample")) for j in jobs} == {
            ("adam", None), ("grape", "materialize"), ("dpadam", "bk")}
    if name == "bench_real_compute":  # one budget for every method: 3 forward-pass equivalents per training example
        assert {j["train"]["compute_budget"] for j in jobs} == {3.0}
        assert {j["algo"]["name"] for j in jobs} >= {"adam", "dpadam", "dpzero", "mezo", "dcdpsgd"}
        assert {j["algo"].get("per_sample") for j in jobs if j["algo"]["name"] == "dpadam"} == {"materialize", "ghost", "bk"}
    if name == "bench_real_calibration":
        assert {j["dataset"]["validation_fraction"] for j in jobs} == {0.2}  # never the test set
        assert len({(j["algo"]["name"], j["train"]["lr"]) for j in jobs}) == len(jobs) == 12
    else:
        for j in jobs:  # one learning rate per optimizer family, from the preset's table
            assert j["train"]["lr"] == j["paper_setting"]["lr"][j["algo"]["name"]]


@pytest.mark.slow  # composes every method of each tuned preset (seconds): the fast tier stays under its 5 minutes
def test_the_tuned_preset_sweeps_existing_keys_of_each_method():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=["experiment=bench_real_tuned"], return_hydra_config=True)
    methods = str(cfg.hydra.sweeper.grid.algo).split(",")
    assert set(methods) == PRIVATE  # every private method of bench_real
    bases = {}
    for method in methods:
        job = compose_point(["experiment=bench_real_tuned", f"algo={method}"], bases)
        assert job.dataset.validation_fraction == 0.2 and not job.privacy.log_private_stats
        for key in job.search_space:
            assert OmegaConf.select(job, key, throw_on_missing=True) is not None, f"{method}: {key}"


PAPER_SETTINGS = {  # the seed papers' own settings, as each preset states them
    "dcdpsgd": {"algo.tail_clip_ratio": 10.0, "algo.subspace_dim": 200, "algo.theta": 2.0, "algo.tail_fraction": 0.1,
                "algo.tail_selection": "rank", "algo.gradient_sensitivity": "rank_coupled",
                "algo.budget_split": "epsilon", "algo.score_epsilon_fraction": 0.5, "privacy.clip_norm": 0.1},
    "dpdr": {"algo.decomposition_steps": 10, "algo.perp_clip": 1.0, "algo.alpha_clip": 1.5, "algo.paper_accounting": False},
    "grape": {"algo.rank": 16, "algo.update_interval": 100},
    "dpzero": {"model.head_init": "zero_shot", "model.trained_blocks": 1, "train.batch_size": 64, "train.steps": 2000,
               "algo.smoothing": 1e-3},
}
OWN_BUDGET = {"dpzero": {"model.trained_blocks", "train.batch_size"}}  # the zeroth-order paper's terms: its own budget


@pytest.mark.parametrize("method", sorted(PAPER_SETTINGS))
def test_a_paper_settings_preset_runs_its_method_as_its_paper_on_bench_reals_task(method):
    """bench_real_paper_<method>: the paper's hyperparameters, bench_real's data, model, batch, steps, epsilon and
    family learning rate (DPZero: its paper's own budget instead), into one folder (bench_real_papers),
    calibrated (sound accounting), 3 seeds."""
    bases = {}
    job = compose_point([f"experiment=bench_real_paper_{method}"], bases)
    reference = compose_point(["experiment=bench_real", f"algo={method}"], bases)
    validate(job)
    assert job.algo.name == method and job.name == "bench_real_papers"
    for key, value in PAPER_SETTINGS[method].items():
        assert OmegaConf.select(job, key) == value, key
    for key in ("dataset.name", "model.name", "model.trained_blocks", "train.batch_size", "train.epochs",
                "privacy.epsilon", "privacy.delta", "train.lr", "train.head_lr_scale"):
        if key not in OWN_BUDGET.get(method, ()):
            assert OmegaConf.select(job, key) == OmegaConf.select(reference, key), key
    assert job.privacy.noise_multiplier is None  # sigma calibrated to epsilon 8 for what runs
    (grid,) = header_grids(f"bench_real_paper_{method}")
    points, _ = grid_points(grid, product=True)
    assert len(points) == 3

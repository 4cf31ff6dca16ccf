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


def test_the_tuned_preset_sweeps_existing_keys_of_each_method():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=["experiment=bench_real_tuned"], return_hydra_config=True)
    methods = str(cfg.hydra.sweeper.grid.algo).split(",")
    assert set(methods) == {"dpadam", "grape", "dplora", "dpsgd", "dpzero"}
    bases = {}
    for method in methods:
        job = compose_point(["experiment=bench_real_tuned", f"algo={method}"], bases)
        assert job.dataset.validation_fraction == 0.2 and not job.privacy.log_private_stats
        for key in job.search_space:
            assert OmegaConf.select(job, key, throw_on_missing=True) is not None, f"{method}: {key}"

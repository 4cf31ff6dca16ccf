"""Every option of every config group composes, and every algorithm runs end to end."""

from pathlib import Path

import pytest
from helpers.config import FIXED_SIGMA, REPO, compose

from dpbench.logging.results import RunResults, read_results
from dpbench.run import run_job

GROUPS = ["dataset", "model", "algo", "accountant", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg[group].name == option


def test_required_options_exist():
    assert {"digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "svhn"} <= set(options("dataset"))
    assert {"vit", "cnn"} <= set(options("model"))
    assert {"adam", "dpsgd", "dpadam"} <= set(options("algo"))
    assert {"rdp", "prv", "gdp", "pld"} == set(options("accountant")) & {"rdp", "prv", "gdp", "pld"}
    assert {"wandb", "none"} <= set(options("logger"))


def test_algo_configs_match_registry():
    from dpbench.algorithms import ALGORITHMS, import_all

    import_all()
    assert set(options("algo")) == set(ALGORITHMS.names())


REQUIRED_KEYS = {
    "privacy": {"epsilon", "target_epsilon", "delta", "noise_multiplier", "sample_rate", "steps", "accountant", "sampling"},
    "metrics": {"test_accuracy", "best_test_accuracy", "train_loss"},
    "memory": {"peak_bytes", "kind", "per_sample_grad_bytes", "optimizer_state_bytes"},
    "throughput": {"samples_per_s", "wall_s"},
    "versions": {"torch", "opacus", "dpbench", "device"},
}


def check_results(results: RunResults) -> None:
    written = results.to_json()  # results.json as the run writes it
    for key in ("algo", "model", "dataset", "seed", "config", "status"):
        assert key in written
    for section, keys in REQUIRED_KEYS.items():
        assert keys <= set(written[section]), f"{section} lacks {keys - set(written[section])}"
    assert 0.0 <= results.metrics.test_accuracy <= 1.0
    assert results.memory.peak_bytes > 0


@pytest.mark.slow  # an end-to-end sweep: the slow tier
@pytest.mark.parametrize("algo", options("algo"))
def test_every_algorithm_runs_end_to_end(algo, tiny_cfg, tmp_path: Path):
    results = run_job(tiny_cfg(f"algo={algo}"), tmp_path, show_progress=False)
    check_results(results)
    assert read_results(tmp_path)["algo"] == algo
    assert results.privacy.steps == 3
    if results.privacy.private:
        assert 0 < results.privacy.epsilon <= 8.0
    else:
        assert results.privacy.epsilon is None and results.privacy.ledger == []


@pytest.mark.slow  # an end-to-end sweep: the slow tier
@pytest.mark.parametrize("model", options("model"))
def test_every_image_model_runs(model, tiny_cfg, tmp_path: Path):
    composed = compose([f"model={model}"]).model
    if composed.get("task_kind", "image") != "image":
        pytest.skip("not an image model")
    if "builder" in composed.keys():
        pytest.skip("a user's model by import path: tests/models/test_user_code.py")
    heavy = ["train.batch_size=4"] if model in ("resnet9", "resnet18") else []  # millions of parameters
    results = run_job(tiny_cfg(f"model={model}", "algo=dpsgd", *heavy, *FIXED_SIGMA), tmp_path, show_progress=False)
    check_results(results)


@pytest.mark.slow  # an end-to-end sweep: the slow tier
@pytest.mark.parametrize("accountant", ["rdp", "prv", "gdp", "pld"])
def test_every_accountant_calibrates_a_run(accountant, tiny_cfg, tmp_path: Path):
    opt_in = ["privacy.allow_approximate_accountant=true"] if accountant == "gdp" else []
    results = run_job(tiny_cfg(f"accountant={accountant}", "algo=dpsgd", *opt_in), tmp_path, show_progress=False)
    assert results.privacy.accountant == accountant
    assert 7.5 <= results.privacy.epsilon <= 8.0 + 1e-9
    assert results.privacy.epsilon_is_upper_bound is (accountant != "gdp")
    # the run's ledger, as dp-accounting events, re-accounted from results.json alone
    from dpbench.tools.report.recheck import recheck_run

    rechecked = recheck_run(tmp_path / "results.json")
    assert rechecked.source == "dp_events" and rechecked.pld_lower <= rechecked.pld_upper
    if accountant != "gdp":
        assert rechecked.consistent and rechecked.recorded_bounds[1] == results.privacy.epsilon
    if accountant == "pld":  # the same events, the same grid rule: dp-accounting's own accountant agrees
        assert results.privacy.epsilon == pytest.approx(rechecked.pld_upper, rel=1e-6)


def test_pyproject_lists_every_subpackage():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "dpbench").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment):
    cfg = compose([f"experiment={experiment}"])
    assert cfg.algo.name and cfg.dataset.name and cfg.model.name

"""A new algorithm is one .py and one .yaml (docs/architecture.md, "Algorithm"): a toy private
algorithm written to a temporary directory, with no edit to any dpbench file, composes with its
typed option, trains end to end, reports epsilon, passes the audit and the one-run audit, meets the
seeded bugs that apply to it, is refused sharding, and runs a private study."""

from __future__ import annotations

import sys

import pytest
from helpers.config import FIXED_SIGMA, TINY, compose
from helpers.toy_algorithms import install, uninstall

from dpbench.algorithms import ALGORITHMS
from dpbench.errors import UserError

TOY_PY = '''
"""Toy: DP-SGD whose step is scaled by an option of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample
from dpbench.options import AlgoOptions

SEEN = []  # the options each instance got (read by the test)


@dataclass
class ToyOptions(AlgoOptions):
    name: str = "toy"
    step_scale: float = 1.0
    per_sample: PerSample = PerSample.materialize


@ALGORITHMS.register("toy", options=ToyOptions)
class Toy(DPFirstOrderAlgorithm):
    def build_optimizer(self, params):
        SEEN.append(self.cfg.step_scale)
        return torch.optim.SGD(params, lr=self.lr * self.cfg.step_scale)

    def extra_results(self):
        return {"step_scale": self.cfg.step_scale}
'''

TOY_YAML = """
# Toy: DP-SGD with a scaled step. dpbench algo=toy algo.step_scale=2
defaults:
  - /algo_toy_schema@_here_   # ToyOptions, toy.py
  - _self_
name: toy
step_scale: 0.5
per_sample: materialize
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """toy.py on the algorithms package's path, toy.yaml on Hydra's search path: the overrides that select it."""
    yield install(tmp_path, monkeypatch, "toy", TOY_PY, TOY_YAML)
    uninstall(monkeypatch, "toy")


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_a_toy_algorithm_from_one_py_and_one_yaml_runs_end_to_end_and_passes_the_audit(toy, tmp_path):
    from dpbench.tools.audit.runner import run_audit
    from dpbench.run import run_job

    cfg = compose(TINY + FIXED_SIGMA + toy + ["algo.step_scale=2"])
    assert "toy" in ALGORITHMS.names()
    module = sys.modules["dpbench.algorithms.toy"]
    assert type(cfg.algo.step_scale) is float and cfg.algo.step_scale == 2.0  # the override's integer, typed

    results = run_job(cfg, tmp_path / "run", show_progress=False)
    assert module.SEEN == [2.0] and type(module.SEEN[0]) is float
    assert results.algorithm["step_scale"] == 2.0
    assert 0.0 <= results.metrics.test_accuracy <= 1.0
    assert results.privacy.epsilon > 0 and results.privacy.noise_multiplier == 1.0

    report = run_audit(compose(TINY + toy + ["audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]), tmp_path)
    assert report.checks and report.passed, [c for c in report.checks if not c.passed]


# a small one-run audit (a CNN of width 8, 200 canaries) and the fast seeded-bug audit's sizes
ONE_RUN = ["dataset=synthetic", "model=cnn", "model.width=8", "model.groups=4", "logger=none", "threads=1",
           "train.batch_size=32", "train.eval_every=0", "audit.one_run=true", "audit.canaries=200", "audit.guesses=100",
           "train.steps=200", "privacy.epsilon=2"]
QUICK_AUDIT = ["dataset=quadratic", "model=quadratic", "dataset.dimension=64", "dataset.train_size=512",
               "dataset.test_size=64", "audit.noise_steps=2", "audit.trials=1", "audit.sensitivity_steps=1", "train.steps=2"]


@pytest.mark.slow  # a one-run audit, a seeded-bug audit and a private study of three trials
def test_the_features_that_ask_the_registry_run_the_toy_with_no_other_file_changed(toy, tmp_path, monkeypatch):
    """The toy declares nothing beyond DPFirstOrderAlgorithm's defaults; each feature reads what it
    declares: the one-run audit places its canaries (canary_site), the stock-phase seeded bugs apply
    and are caught (runs_stock_phases), train.sharding=fsdp refuses it in one line (not shardable),
    and a private study runs its trials and publishes one."""
    import json

    from helpers.cli import dpbench_in_process

    from dpbench.algorithms.base import EXAMPLES
    from dpbench.runtime import sharding
    from dpbench.study import publish
    from dpbench.tools.audit.runner import run_audit
    from dpbench.tools.audit.seeded_bugs import CATALOGUE, CATALOGUE_DEFAULTS, run_bug

    toy_cls = ALGORITHMS.get("toy")
    assert toy_cls.canary_site == EXAMPLES and toy_cls.runs_stock_phases() and not toy_cls.stated("shardable")

    report = run_audit(compose(ONE_RUN + toy), tmp_path / "one_run")
    assert [c.name for c in report.checks] == ["one_run"] and report.passed, report.checks

    applying = [name for name in CATALOGUE if "toy" in CATALOGUE[name].algorithms()]
    assert "noise_half" in applying and "dcdpsgd_mixture_noise" not in applying
    _, bug = run_bug(compose(CATALOGUE_DEFAULTS + QUICK_AUDIT + toy), "noise_half", tmp_path / "bug")
    assert bug.caught and bug.ok

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="^algo=toy is not supported: train.sharding=fsdp supports algo="):
        sharding.check_supported(compose(TINY + toy + ["train.sharding=fsdp"]), ALGORITHMS)
    monkeypatch.delenv("WORLD_SIZE")

    folder = tmp_path / "study"
    folder.mkdir()
    done = dpbench_in_process("-m", "hydra/sweeper=private_search", "hydra.sweeper.mean_trials=3", "hydra.sweeper.shape=1",
                              "train.lr=tag(log, interval(0.003, 0.3))", "privacy.epsilon=3", "train.steps=5",
                              "dataset=synthetic", "dataset.validation_fraction=0.3", "train.batch_size=64",
                              "model=cnn", "model.width=8", "model.groups=4", "logger=none", "name=study", *toy,
                              cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((folder / "outputs" / "multirun" / "study" / publish.STUDY_FILE).read_text())
    assert summary["task"]["algo"] == "toy" and 0 < summary["epsilon_study"] <= 3.0 + 1e-6


def test_the_toy_yaml_default_applies_and_a_bad_value_of_its_option_is_one_line(toy):
    assert compose(TINY + toy).algo.step_scale == 0.5  # the YAML's value over the dataclass default
    with pytest.raises(UserError, match=r"^algo.step_scale must be a number, got 'fast'$"):
        compose(TINY + toy + ["algo.step_scale=fast"])
    with pytest.raises(UserError, match=r"^algo.per_sample='vmap' is not known; use one of bk, ghost, materialize$"):
        compose(TINY + toy + ["algo.per_sample=vmap"])


def test_without_the_toy_files_the_algorithm_is_unknown():
    with pytest.raises(Exception, match="toy"):
        compose(TINY + ["algo=toy"])
    assert "toy" not in ALGORITHMS.names()

"""A new algorithm is one .py and one .yaml (dpbench/ARCHITECTURE.md, "Algorithm"): a toy private
algorithm written to a temporary directory, with no edit to any dpbench file, composes with its
typed option, trains end to end, reports epsilon and passes the audit."""

from __future__ import annotations

import sys
import textwrap

import pytest
from helpers.config import FIXED_SIGMA, TINY, compose

import dpbench.algorithms
from dpbench.algorithms import ALGORITHMS
from dpbench.errors import UserError

TOY_PY = '''
"""Toy: DP-SGD whose step is scaled by an option of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.algorithms.base import ALGORITHMS, DPFirstOrderAlgorithm, PerSample
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
    """toy.py in a directory appended to the algorithms package's path, toy.yaml in a config
    directory on Hydra's search path: the overrides that select it."""
    code, conf = tmp_path / "algorithms", tmp_path / "conf"
    (conf / "algo").mkdir(parents=True)
    code.mkdir()
    (code / "toy.py").write_text(textwrap.dedent(TOY_PY))
    (conf / "algo" / "toy.yaml").write_text(TOY_YAML)
    ALGORITHMS.names()  # the package already discovered, as in a process that ran other things first
    monkeypatch.setattr(dpbench.algorithms, "__path__", [*dpbench.algorithms.__path__, str(code)])
    yield [f"hydra.searchpath=[file://{conf}]", "algo=toy"]
    ALGORITHMS.unregister("toy")  # leave the registry as the package has it
    sys.modules.pop("dpbench.algorithms.toy", None)
    monkeypatch.delattr(dpbench.algorithms, "toy", raising=False)


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

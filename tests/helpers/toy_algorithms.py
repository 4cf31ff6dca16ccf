"""Toy algorithms written as a newcomer writes one: a .py and a .yaml in a temporary directory, with no
edit to any dpbench file; the features and tests that iterate the registry must pick them up."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import dpbench.algorithms
from dpbench.algorithms import ALGORITHMS

# DP-SGD on the modules its own option names (not LoRA's `train_modules`): what it trains is declared
# on its class (`trained_modules_option`), as the one-run audit's canary layer needs it.
PARTIAL_PY = '''
"""Partial: DP-SGD on the modules `algo.full_modules` names (null: the model family's trained modules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from dpbench.algorithms.base import ALGORITHMS
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm, PerSample
from dpbench.models import ModelFamily, family_of
from dpbench.options import AlgoOptions


@dataclass
class PartialOptions(AlgoOptions):
    name: str = "partial"
    full_modules: Optional[List[str]] = None
    per_sample: PerSample = PerSample.materialize


@ALGORITHMS.register("partial", options=PartialOptions)
class Partial(DPFirstOrderAlgorithm):
    trained_modules_option = "full_modules"

    def __init__(self, model, task, cfg, lr, privacy):
        names = cfg.full_modules if cfg.full_modules is not None else (family_of(model) or ModelFamily()).trained_modules
        for name, param in model.named_parameters():
            param.requires_grad = any(name.startswith(module + ".") for module in names)
        super().__init__(model, task, cfg, lr, privacy)

    def build_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr)
'''

PARTIAL_YAML = """
# Partial: DP-SGD on named modules only. dpbench algo=partial algo.full_modules=[head]
defaults:
  - /algo_partial_schema@_here_   # PartialOptions, partial.py
  - _self_
name: partial
full_modules: null
per_sample: materialize
default_lr: 0.5
lr_family: sgd
"""


def install(tmp_path: Path, monkeypatch, name: str, code: str, yaml: str) -> list[str]:
    """`name`.py in a directory appended to the algorithms package's path, `name`.yaml in a config
    directory on Hydra's search path: the overrides that select it. `uninstall` undoes it."""
    package, conf = tmp_path / f"{name}_algorithms", tmp_path / f"{name}_conf"
    (conf / "algo").mkdir(parents=True)
    package.mkdir()
    (package / f"{name}.py").write_text(textwrap.dedent(code))
    (conf / "algo" / f"{name}.yaml").write_text(yaml)
    ALGORITHMS.names()  # the package already discovered, as in a process that ran other things first
    monkeypatch.setattr(dpbench.algorithms, "__path__", [*dpbench.algorithms.__path__, str(package)])
    return [f"hydra.searchpath=[file://{conf}]", f"algo={name}"]


def uninstall(monkeypatch, name: str) -> None:
    ALGORITHMS.unregister(name)  # leave the registry as the package has it
    sys.modules.pop(f"dpbench.algorithms.{name}", None)
    monkeypatch.delattr(dpbench.algorithms, name, raising=False)


@pytest.fixture
def partial_toy(tmp_path, monkeypatch):
    """The `partial` toy installed: the overrides that select it."""
    yield install(tmp_path, monkeypatch, "partial", PARTIAL_PY, PARTIAL_YAML)
    uninstall(monkeypatch, "partial")

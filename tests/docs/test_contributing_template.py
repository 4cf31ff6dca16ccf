"""docs/contributing.md's algorithm template is complete: its two blocks, installed as they are (the
.py on the algorithms package's path, the .yaml on Hydra's), compose, build and train a step."""

from __future__ import annotations

import re

import torch
from helpers.algorithms import tiny_model
from helpers.config import OFFLINE, REPO, compose
from helpers.toy_algorithms import install, uninstall

from dpbench.algorithms import ALGORITHMS, PrivacySetup
from dpbench.privacy.noise import GaussianNoise
from dpbench.tasks import build_task


def template_blocks() -> dict[str, str]:
    """{file name: text} of the page's code blocks that open with `# <file>, in <folder>/`."""
    page = (REPO / "docs" / "contributing.md").read_text()
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+), in \S+/\n(.*?)```", page, flags=re.S)
    return dict(blocks)


def test_the_algorithm_template_composes_builds_and_steps(tmp_path, monkeypatch):
    blocks = template_blocks()
    assert set(blocks) == {"nesterov.py", "nesterov.yaml"}
    selection = install(tmp_path, monkeypatch, "nesterov", blocks["nesterov.py"], blocks["nesterov.yaml"])
    try:
        cfg = compose([*OFFLINE, *selection, "dataset=synthetic"])
        assert cfg.train.lr == 1.0 and cfg.algo.momentum == 0.9
        cls = ALGORITHMS.get("nesterov")
        assert cls.private and not cls.stated("shardable") and cls.runs_stock_phases()
        task = build_task(cfg, torch.device("cpu"))
        setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=8.0,
                             sample_rate=8 / task.train_size, noise=GaussianNoise("cpu"))
        algorithm = cls(tiny_model(), task, cfg.algo, 0.1, setup)
        before = [p.detach().clone() for p in algorithm.params]
        result = algorithm.train_step([task.batch(list(range(8)))], 0)
        assert result.batch_size == 8 and len(result.mechanisms) == 1
        assert all(not torch.equal(b, p) for b, p in zip(before, algorithm.params))
    finally:
        uninstall(monkeypatch, "nesterov")

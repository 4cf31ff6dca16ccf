"""The sensitivity matrix on a BERT encoder (the real tier's architecture: embeddings frozen, the
top layer and the head trained, padded sentences with attention masks): for each algorithm and
engine that trains it, in fp32 and bf16, one added example moves each noiseless release by at most
1.0001 × its declared sensitivity, or the combination is refused in one line.

The clip norm is tiny (1e-4), so every example is clipped and the 256 clipped gradients of a batch
sum to about B·C: the size at which a low-precision sum's rounding would exceed C."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.config import OFFLINE, compose
from helpers.tiny_bert import corpus_rows, write_corpus, write_tiny_bert
from test_sensitivity_matrix import ZeroNoise, step_releases

from dpbench.algorithms import algorithm_class
from dpbench.errors import UserError
from dpbench.privacy.plan import PrivacySetup
from dpbench.tasks import build_task

BATCH = 256
CLIP = 1e-4
pytestmark = pytest.mark.slow  # the engine x algorithm matrix on BERT: the slow tier (the issue "A real tier")
CASES = [("dpadam", "materialize"), ("dpadam", "ghost"), ("dpadam", "bk"), ("grape", "materialize"), ("grape", "bk"),
         ("dpsgd", "bk"), ("dplora", "materialize"), ("dpzero", None)]


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_sensitivity")
    return write_tiny_bert(folder / "model"), write_corpus(folder / "corpus.csv.bz2", corpus_rows(movies=120, per_movie=3))


@functools.cache
def _cfg(model: str, corpus: str, name: str, engine: str | None):
    overrides = [f"algo.per_sample={engine}"] if engine else []
    return compose([*OFFLINE, f"algo={name}", "model=minilm", f"model.path={model}", "model.trained_blocks=1",
                    "dataset=rt_snippets", f"dataset.path={corpus}", "dataset.test_fraction=0.05",
                    "dataset.max_length=8", *overrides])


def _released(files, name, engine, precision, examples):
    cfg = _cfg(str(files[0]), str(files[1]), name, engine)
    task = build_task(cfg, torch.device("cpu"))
    torch.manual_seed(0)  # the same fresh head in both neighbouring runs
    model = task.build_model(cfg.model).train()  # as dpbench.run.setup: from_pretrained returns eval mode
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=CLIP, expected_batch_size=float(BATCH), sample_rate=0.5,
                         noise=ZeroNoise())
    return step_releases(algorithm_class(name)(model, task, cfg.algo, 1e-3, setup), precision, task, examples)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name,engine", CASES, ids=[f"{n}-{e or 'own'}" for n, e in CASES])
def test_one_added_example_moves_each_bert_release_by_at_most_its_sensitivity(bert_files, name, engine, precision):
    try:
        without = _released(bert_files, name, engine, precision, BATCH)
    except UserError as refused:  # refused before training, with one line
        assert "\n" not in str(refused) and "train.precision" in str(refused), refused
        return
    with_one_more = _released(bert_files, name, engine, precision, BATCH + 1)
    assert without and set(without) == set(with_one_more)
    for release, parts in without.items():
        for (a, sensitivity), (b, _) in zip(parts, with_one_more[release]):
            assert sensitivity > 0 and a.numel() == b.numel()
            moved = (a - b).norm().item()
            assert moved <= 1.0001 * sensitivity, f"{release}: moved {moved / sensitivity:.4f}× its sensitivity"
            # the batch's own clipped sum is there, so the comparison can fail (DPZero's per-example
            # scalars are clipped to +-C: a batch of as many signs of each sums to 0, its neighbour not)
            assert a.abs().sum() > 0 or b.abs().sum() > 0

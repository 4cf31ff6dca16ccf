"""Preprocessing is a function of public data only: image normalisation uses fixed published
constants, and a tiny language model's tokenizer is trained on public text. An un-trained run
(train.steps=0, ε 0) must therefore release nothing that depends on a training record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.config import compose
from helpers.text_data import write_dataset

from dpbench.data import DATASETS
from dpbench.data.images import PUBLIC_STATS, TORCHVISION

CPU = torch.device("cpu")


# --- images -----------------------------------------------------------------------------------
def _digits_test_loss(run_dir, edit=None, monkeypatch=None) -> float:
    """Test loss of an un-trained default run (ViT on digits) whose training split went through
    `edit` (train images, train labels) -> (train images, train labels) before preprocessing."""
    import sklearn.model_selection

    from dpbench.run import run_job

    if edit is not None:
        split = sklearn.model_selection.train_test_split

        def edited_split(*arrays, **kwargs):
            train_x, test_x, train_y, test_y = split(*arrays, **kwargs)
            train_x, train_y = edit(train_x, train_y)
            return train_x, test_x, train_y, test_y

        monkeypatch.setattr(sklearn.model_selection, "train_test_split", edited_split)
    results = run_job(compose(["logger=none", "train.steps=0"]), run_dir, show_progress=False)
    assert results.status == "completed" and results.privacy.steps == 0 and not results.privacy.epsilon
    return results.metrics.test_loss


def _drop_first(x, y):
    return x[1:], y[1:]


def _change_first(x, y):
    x = x.copy()
    x[0] = 1.0  # every pixel at the format's maximum (16/16)
    return x, y


@pytest.fixture(scope="module")
def full_loss(tmp_path_factory) -> float:
    return _digits_test_loss(tmp_path_factory.mktemp("full"))


@pytest.mark.parametrize("edit", [_drop_first, _change_first], ids=["drop_record_0", "change_record_0"])
def test_untrained_run_does_not_depend_on_a_training_record(tmp_path, monkeypatch, full_loss, edit):
    neighbour = _digits_test_loss(tmp_path, edit, monkeypatch)
    assert full_loss == neighbour  # exact: each input is a fixed map of its own record alone


def test_digits_are_scaled_by_fixed_constants():
    """digits: x/16 (the format's 0..16 range), then (x - 0.5)/0.5: inputs lie in [-1, 1] and a
    pixel's value alone decides its input."""
    from sklearn.datasets import load_digits

    data = DATASETS.get("digits")(compose([]).dataset, 0)
    values = torch.cat([data.train_images.flatten(), data.test_images.flatten()]).unique()
    expected = torch.tensor(np.unique(load_digits().images), dtype=torch.float32) / 16.0 * 2.0 - 1.0
    assert torch.allclose(values, expected)
    assert values.min() == -1.0 and values.max() == 1.0


def test_every_image_dataset_has_public_constants():
    for name in [*TORCHVISION, "digits", "imagenette"]:
        mean, std = PUBLIC_STATS[name]
        assert len(mean) == len(std) in (1, 3) and all(0 < s < 1 for s in std)


# --- tiny language tokenizers -----------------------------------------------------------------
RARE = "zorblaxquintessor"


@pytest.mark.parametrize("model_name,dataset", [("roberta", "sst2"), ("opt", "boolq")])
def test_tiny_tokenizer_ignores_the_training_text(tmp_path, model_name, dataset):
    from dpbench.tasks import build_task

    rare_row = {"sst2": {"sentence": f"the {RARE} film is {RARE} .", "label": 1},
                "boolq": {"question": f"is the {RARE} blue", "passage": f"The {RARE} is blue.", "answer": True}}[dataset]
    vocabularies = []
    for with_record in (False, True):
        root = tmp_path / str(with_record)
        folder = write_dataset(root, dataset, n_train=12, n_test=4)
        if with_record:
            with open(folder / "train.jsonl", "a") as f:
                f.write(json.dumps(rare_row) + "\n")
        cfg = compose([f"dataset={dataset}", f"dataset.path={folder}", f"model={model_name}", "model.size=tiny",
                       "logger=none"])
        task = build_task(cfg, CPU)
        assert (rare_row in task.train_rows) == with_record  # the record reached the task
        vocabularies.append(task.tokenizer.get_vocab())
        assert len(task.tokenizer.tokenize(" " + RARE)) > 1  # byte-level pieces, not an entry
    assert vocabularies[0] == vocabularies[1]

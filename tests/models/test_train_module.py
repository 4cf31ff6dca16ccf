"""`dpbench.api.train_module`: a user's nn.Module and map-style datasets trained from Python with a
dpbench algorithm (the make_private habit), through the same checks as the config route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpbench.api import train_module
from dpbench.errors import UserError

SMALL = ["logger=none", "train.steps=2", "train.batch_size=32", "train.eval_every=2"]


def clusters(n: int, generator: torch.Generator) -> TensorDataset:
    labels = torch.arange(n) % 3
    return TensorDataset(torch.randn(n, 6, generator=generator) + 3 * F.one_hot(labels, 6).float(), labels)


def data():
    generator = torch.Generator().manual_seed(0)
    return clusters(120, generator), clusters(30, generator)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def per_example(outputs, labels):
    return F.cross_entropy(outputs, labels, reduction="none")


def test_a_users_module_is_trained_in_place_with_its_own_loss(tmp_path):
    model, (train, test) = mlp(), data()
    before = model[0].weight.detach().clone()
    results = train_module(model, train, test, num_classes=3, overrides=["algo=grape", *SMALL], loss=per_example,
                           trained_modules=["2"], run_dir=tmp_path / "run", quiet=True)
    assert results.status == "completed" and results.model == "module" and 0 < results.privacy.epsilon <= 8
    assert results.algorithm["projected_layers"] == ["0"]  # every Linear outside the declared head
    assert not torch.equal(model[0].weight.detach(), before)  # the caller's module itself was trained


def batch_mean(outputs, labels):
    return F.cross_entropy(outputs, labels)


def centred(outputs, labels):
    losses = F.cross_entropy(outputs, labels, reduction="none")
    return losses - losses.mean()  # one example's loss depends on the others


REFUSED = {
    "a DataLoader": (lambda train: {"train": DataLoader(train, batch_size=8)}, {}, [],
                     "train_module: train is a DataLoader; return its map-style dataset"),
    "a model override": (lambda train: {}, {}, ["model=cnn"], "leave model=cnn out of overrides"),
    "a batch-mean loss": (lambda train: {}, {"loss": batch_mean}, [],
                          "returned a scalar; it must return one loss per example"),
    "a loss that mixes examples": (lambda train: {}, {"loss": centred}, [], "mixes examples within the rows"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_train_module_refuses_is_one_line(case, tmp_path):
    splits, keywords, overrides, message = REFUSED[case]
    train, test = data()
    arguments = {"train": train, "test": test, **splits(train)}
    with pytest.raises(UserError, match=message) as refused:
        train_module(mlp(), arguments["train"], arguments["test"], num_classes=3, overrides=["algo=dpsgd", *SMALL, *overrides],
                     run_dir=tmp_path / "run", quiet=True, **keywords)
    assert "\n" not in str(refused.value)

"""A researcher's own package outside the repository, written to a folder as docs/bring-your-own.md
shows it: a tiny MLP and a CSV dataset (`my_dp`), their configs (`my_conf/model/my_mlp.yaml`,
`my_conf/dataset/my_csv.yaml`, a preset `my_conf/experiment/mine.yaml`), and models and datasets dpbench must refuse (`my_dp/bad.py`)."""

from __future__ import annotations

import random
from pathlib import Path

MODELS = '''
import math

from torch import nn


def tiny_mlp(model_cfg, spec):
    """(model_cfg, spec) -> nn.Module, as dpbench calls it: spec says the input shape and classes."""
    hidden = int(model_cfg.get("hidden", 16))
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.input_shape), hidden), nn.Tanh(),
                         nn.Linear(hidden, spec.num_classes))
'''

DATA = '''
import csv
from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def read_csv(path):
    rows = list(csv.reader(Path(path).open()))
    features = torch.tensor([[float(v) for v in row[:-1]] for row in rows])
    labels = torch.tensor([int(row[-1]) for row in rows])
    return TensorDataset(features, labels)


def csv_data(dataset_cfg, seed):
    """(dataset_cfg, seed) -> train and test map-style datasets of (x, y) and num_classes."""
    folder = Path(dataset_cfg.folder)
    return {"train": read_csv(folder / "train.csv"), "test": read_csv(folder / "test.csv"),
            "num_classes": int(dataset_cfg.num_classes)}
'''

BAD = '''
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from my_dp.data import csv_data


def batch_norm_mlp(model_cfg, spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.input_shape), 8), nn.BatchNorm1d(8),
                         nn.Linear(8, spec.num_classes))


class SequenceFirst(nn.Module):
    """Each feature is a time step of an LSTM fed [T, B, 1] (nn.LSTM's default: sequence first)."""

    def __init__(self, classes):
        super().__init__()
        self.lstm = nn.LSTM(1, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        out, _ = self.lstm(x.flatten(1).t()[:, :, None])
        return self.head(out[-1])


def lstm_model(model_cfg, spec):
    return SequenceFirst(spec.num_classes)


class SequenceFirstAttention(nn.Module):
    """Opacus's DPMultiheadAttention with batch_first=False, fed [T, B, d]: its rows mix examples."""

    def __init__(self, classes):
        super().__init__()
        from opacus.layers import DPMultiheadAttention

        self.embed = nn.Linear(1, 8)
        self.attention = DPMultiheadAttention(8, 2, batch_first=False)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        tokens = self.embed(x.flatten(1).t()[:, :, None])
        out, _ = self.attention(tokens, tokens, tokens)
        return self.head(out.mean(0))


def sequence_first_attention(model_cfg, spec):
    return SequenceFirstAttention(spec.num_classes)


class RunningMean(nn.Module):
    """Centres inputs with a running mean of the batches: a buffer written from private data."""

    def __init__(self, features, classes):
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.linear(x - self.mean)


def running_mean(model_cfg, spec):
    return RunningMean(math.prod(spec.input_shape), spec.num_classes)


class SharedWeight(nn.Module):
    """The head also reads the first layer's weight, outside that layer's forward: the per-example
    engine never sees that part of its gradient."""

    def __init__(self, features, classes):
        super().__init__()
        self.first = nn.Linear(features, features)
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)) @ self.first.weight)


def shared_weight(model_cfg, spec):
    return SharedWeight(math.prod(spec.input_shape), spec.num_classes)


def loader_data(dataset_cfg, seed):
    data = csv_data(dataset_cfg, seed)
    return {**data, "train": DataLoader(data["train"], batch_size=32)}


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


def iterable_data(dataset_cfg, seed):
    return {**csv_data(dataset_cfg, seed), "train": Stream()}


def too_few_classes(dataset_cfg, seed):
    return {**csv_data(dataset_cfg, seed), "num_classes": 2}
'''

MODEL_CONFIG = '''name: my_mlp
builder: my_dp.models:tiny_mlp   # package.module:function, called as (model_cfg, spec)
hidden: 16
trained_modules: ["3"]           # the last Linear is the head; DP-GRAPE projects the other
'''

DATASET_CONFIG = '''name: my_csv
task: image_classification       # dpbench's classification of tensors (any shape)
builder: my_dp.data:csv_data     # package.module:function, called as (dataset_cfg, seed)
folder: {folder}
num_classes: 3
validation_fraction: 0.0
'''

EXPERIMENT_CONFIG = '''# @package _global_
# A preset of the user's own: dpbench hydra.searchpath=[file://<folder>/my_conf] experiment=mine
defaults:
  - override /model: my_mlp
  - override /dataset: my_csv
  - override /algo: grape
train:
  epochs: 2
  batch_size: 64
'''

CLASSES, FEATURES = 3, 6


def write_csv(path: Path, rows: int, rng: random.Random, centres) -> None:
    with path.open("w") as f:
        for i in range(rows):
            label = i % CLASSES
            f.write(",".join(f"{c + rng.gauss(0, 0.7):.4f}" for c in centres[label]) + f",{label}\n")


def write_user_package(folder: Path) -> Path:
    """The user's folder (to put on PYTHONPATH); its configs are in <folder>/my_conf."""
    package, conf = folder / "my_dp", folder / "my_conf"
    for path in (package, conf / "model", conf / "dataset", conf / "experiment", folder / "data"):
        path.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (conf / "__init__.py").write_text("")  # importable too: hydra.searchpath=[pkg://my_conf]
    (conf / "experiment" / "mine.yaml").write_text(EXPERIMENT_CONFIG)
    (package / "models.py").write_text(MODELS)
    (package / "data.py").write_text(DATA)
    (package / "bad.py").write_text(BAD)
    (conf / "model" / "my_mlp.yaml").write_text(MODEL_CONFIG)
    (conf / "dataset" / "my_csv.yaml").write_text(DATASET_CONFIG.format(folder=folder / "data"))
    rng = random.Random(0)  # separable Gaussian clusters: learnable in a few private steps
    centres = [[rng.gauss(0, 1.5) for _ in range(FEATURES)] for _ in range(CLASSES)]
    write_csv(folder / "data" / "train.csv", 300, rng, centres)
    write_csv(folder / "data" / "test.csv", 90, rng, centres)
    return folder

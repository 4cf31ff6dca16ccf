"""A researcher's own package outside the repository, written to a folder from the worked example of
docs/bring-your-own.md (its code blocks, so the page is what the tests run): a tiny MLP and a CSV
dataset (`my_dp`), their configs (`my_conf/model/my_mlp.yaml`, `my_conf/dataset/my_csv.yaml`), a
preset (`my_conf/experiment/mine.yaml`), and models and datasets dpbench must refuse (`my_dp/bad.py`)."""

from __future__ import annotations

import random
import re
from pathlib import Path

from helpers.config import REPO

DOCUMENT = REPO / "docs" / "bring-your-own.md"


def documented(path: str) -> str:
    """The code block the worked example of docs/bring-your-own.md shows for `path`."""
    found = re.search(rf"^`{re.escape(path)}`.*?\n```(?:python|yaml)\n(.*?)```", DOCUMENT.read_text(), re.S | re.M)
    assert found, f"docs/bring-your-own.md shows no code block for {path}"
    return found.group(1)


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


class CentresLargeBatches(nn.Module):
    """Centres its batch only when it holds more than 4 examples: a probe of 3 or 4 records misses it."""

    def __init__(self, features, classes):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.linear(x - x.mean(0, keepdim=True) if x.shape[0] > 4 else x)


def centre_large_batches(model_cfg, spec):
    return CentresLargeBatches(math.prod(spec.input_shape), spec.num_classes)


class FlipMixes(nn.Module):
    """Mixes each example with its mirror in the batch: the middle of three records stays put."""

    def __init__(self, features, classes):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.linear(x + 0.1 * x.flip(0))


def flip_mix(model_cfg, spec):
    return FlipMixes(math.prod(spec.input_shape), spec.num_classes)


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


def wrong_input_mlp(model_cfg, spec):  # a first layer built for another data set's width
    return nn.Sequential(nn.Linear(math.prod(spec.input_shape) + 4, 8), nn.Tanh(), nn.Linear(8, spec.num_classes))


def wrong_output_mlp(model_cfg, spec):  # more outputs than classes: cross-entropy would train it silently
    return nn.Sequential(nn.Linear(math.prod(spec.input_shape), 8), nn.Tanh(), nn.Linear(8, spec.num_classes + 2))


class DictOutput(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        return {"scores": self.linear(x)}


def dict_output(model_cfg, spec):
    return DictOutput(math.prod(spec.input_shape), spec.num_classes)


def raising_model(model_cfg, spec):
    return nn.Linear(model_cfg.widht, spec.num_classes)  # a typo of the user's: an exception in their builder


def bracketed_error(model_cfg, spec):
    raise ValueError("expected inputs of shape [batch, features]")  # printed as text, not console markup


def raising_data(dataset_cfg, seed):
    raise FileNotFoundError("no such file: data/trian.csv")


def fractional_labels(dataset_cfg, seed):  # regression targets in [0, 1) given as labels
    data = csv_data(dataset_cfg, seed)
    features, labels = data["train"].tensors
    return {**data, "train": torch.utils.data.TensorDataset(features, labels.float() * 0.3)}
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
    for path in ("my_dp/models.py", "my_dp/data.py", "my_dp/hf.py", "my_conf/model/my_mlp.yaml",
                 "my_conf/experiment/mine.yaml"):
        (folder / path).write_text(documented(path))
    # the data folder as an absolute path: tests run dpbench from folders of their own
    dataset = documented("my_conf/dataset/my_csv.yaml")
    (conf / "dataset" / "my_csv.yaml").write_text(dataset.replace("folder: data\n", f"folder: {folder / 'data'}\n"))
    (package / "bad.py").write_text(BAD)
    rng = random.Random(0)  # separable Gaussian clusters: learnable in a few private steps
    centres = [[rng.gauss(0, 1.5) for _ in range(FEATURES)] for _ in range(CLASSES)]
    write_csv(folder / "data" / "train.csv", 300, rng, centres)
    write_csv(folder / "data" / "test.csv", 90, rng, centres)
    return folder

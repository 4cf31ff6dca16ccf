"""The validation split (`dataset.validation_fraction` f): validation examples taken out of the
TRAINING set, so that selecting hyperparameters never reads the test set.

Which part an example is in is a function of that example alone: a keyed hash (BLAKE2b with the
public fixed key `VALIDATION_KEY`) of its content (an image's bytes and label, a text row's fields,
a synthetic point's coordinates), mapped to [0, 1) and compared with f. Why not a seeded
permutation: with a hash, adding or removing one example moves no other example between the
parts, so the split is a per-record function and the training part's neighbouring relation is
the dataset's (a neighbour of the loaded set gives a neighbouring training part, or the same one
with a neighbouring validation part). A permutation of n examples reshuffles every assignment
when n changes. Identical examples land in the same part.

Sizes: n, the training set as loaded, is public (dpbench already treats it so for q = B / n).
q, B, T and the validation score's divisor come from the public sizes `planned_train_size` =
n (1 - f) rounded half up and `planned_validation_size` = n - planned_train_size (about n f),
never from the realised part sizes (which depend on the data); the sampler draws over the
realised training part.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch

from dpbench.errors import UserError

VALIDATION_KEY = b"dpbench-validation-v1"  # public and fixed: the split is reproducible by anyone


def validation_fraction(dataset_cfg) -> float:
    """`dataset.validation_fraction` (0: no split), checked to lie in [0, 1)."""
    value = dataset_cfg.get("validation_fraction", 0) or 0
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = math.nan
    if not 0 <= fraction < 1:
        raise UserError(f"dataset.validation_fraction={value} must lie in [0, 1) (0: no validation split); "
                        "e.g. dataset.validation_fraction=0.2")
    return fraction


def unit_hash(content: bytes) -> float:
    """The example's keyed hash as a number in [0, 1)."""
    digest = hashlib.blake2b(content, key=VALIDATION_KEY, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def in_validation(contents: Iterable[bytes], fraction: float) -> list[bool]:
    """Whether each example (its content's bytes) is a validation example: unit_hash < f."""
    return [unit_hash(content) < fraction for content in contents]


def tensor_rows(values: torch.Tensor, labels: torch.Tensor | None = None) -> list[bytes]:
    """Each row's content as bytes: its values (contiguous, as stored) and its label."""
    array = values.detach().cpu().contiguous().numpy()
    rows = [array[i].tobytes() for i in range(len(array))]
    if labels is None:
        return rows
    return [row + int(label).to_bytes(8, "little", signed=True) for row, label in zip(rows, labels.tolist())]


def text_rows(rows: list[dict]) -> list[bytes]:
    """Each text row's fields (its label among them) as bytes, in a fixed key order."""
    import json

    return [json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode() for row in rows]


@dataclass(frozen=True)
class ValidationSplit:
    fraction: float  # f
    loaded_size: int  # n: the training set as loaded (public)
    train_indices: list[int]  # realised training part (indices into the loaded training set)
    validation_indices: list[int]  # realised validation part

    @property
    def planned_train_size(self) -> int:
        """n (1 - f), rounded half up: the public size q, B and T are planned with."""
        return planned_train_size(self.loaded_size, self.fraction)

    @property
    def planned_validation_size(self) -> int:
        """n - planned_train_size (about n f): the public divisor of the validation score."""
        return self.loaded_size - self.planned_train_size


def planned_train_size(n: int, fraction: float) -> int:
    return math.floor(n * (1 - fraction) + 0.5)


def split_training_set(dataset_cfg, contents: list[bytes]) -> ValidationSplit | None:
    """The split of a training set whose examples have these contents (None: f = 0)."""
    fraction = validation_fraction(dataset_cfg)
    if fraction == 0:
        return None
    n = len(contents)
    planned = planned_train_size(n, fraction)
    mask = in_validation(contents, fraction)
    validation = [i for i, held in enumerate(mask) if held]
    train = [i for i, held in enumerate(mask) if not held]
    if not 0 < planned < n:  # public sizes only: a realised part (even empty) is never refused
        raise UserError(f"dataset.validation_fraction={fraction} leaves an empty training or validation part of the "
                        f"{n} training examples; choose a fraction between {1 / n:.3g} and {1 - 1 / n:.3g}")
    return ValidationSplit(fraction, n, train, validation)

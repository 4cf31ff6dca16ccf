"""A researcher's own dataset, by import path (`dataset.builder=package.module:function`), with no
edit to dpbench: the builder is called as `(dataset_cfg, seed)` like dpbench's loaders and returns
`train` and `test` map-style datasets (`__len__` and `__getitem__`) of `(x, y)` pairs and the public
`num_classes` (a mapping or an object with those attributes; `UserData` is one).

Both splits are read once into tensors and run as dpbench's tensor classification task
(`dataset.task: image_classification`, any input shape): batches come from dpbench's own sampler
(Poisson by default), which the accounting assumes. A DataLoader, an IterableDataset or a dataset
without a length is refused in one line: their order and batch sizes would be theirs, not the
sampler's. Inputs are used as given: normalise them with public constants, never statistics of
the training split (docs/bring-your-own.md).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from dpbench.data import ImageDataset
from dpbench.errors import UserError
from dpbench.models.user import SIGNATURES, builder_of, call_builder


# Inputs of these dtypes are token ids (a Hugging Face model's input_ids) and stay integers (int64);
# every other input becomes float32: uint8 and bool are pixels and masks, as torchvision gives them.
TOKEN_DTYPES = (torch.int16, torch.int32, torch.int64)


@dataclass
class UserData:
    """What a dataset builder may return (any object or mapping with these names will do)."""

    train: Any  # map-style: len(train), train[i] -> (x, y)
    test: Any
    num_classes: int  # public: from the data's documentation, never counted from the labels


def load_user_dataset(cfg, seed: int) -> ImageDataset:
    path = cfg.get("builder")
    data = call_builder(builder_of(cfg, "dataset"), cfg, "dataset", cfg, seed)
    num_classes = _field(data, "num_classes", path)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise UserError(f"dataset.builder={path}: num_classes must be an integer >= 2, got {num_classes!r}")
    train_x, train_y = _tensors(_field(data, "train", path), "train", path, num_classes)
    test_x, test_y = _tensors(_field(data, "test", path), "test", path, num_classes)
    if train_x.dtype != test_x.dtype:
        raise UserError(f"dataset.builder={path}: train inputs are {train_x.dtype} but test inputs {test_x.dtype}; "
                        "give both splits integer token ids or both numbers")
    if train_x.shape[1:] != test_x.shape[1:]:
        raise UserError(f"dataset.builder={path}: train inputs have shape {tuple(train_x.shape[1:])} but test inputs "
                        f"{tuple(test_x.shape[1:])}; give both splits one input shape")
    return ImageDataset(train_x, train_y, test_x, test_y, num_classes, int(cfg.get("patch_size") or 1))


def _field(data, name: str, path: str):
    value = data.get(name) if isinstance(data, dict) else getattr(data, name, None)
    if value is None:
        raise UserError(f"dataset.builder={path} returned a {type(data).__name__} without {name!r}; "
                        f"return {SIGNATURES['dataset']}")
    return value


def check_map_style(split, where: str) -> None:
    """One line unless `split` is a map-style dataset of known size; `where` starts the line."""
    if isinstance(split, DataLoader):
        raise UserError(f"{where} a DataLoader; return its map-style dataset (loader.dataset): dpbench draws the "
                        "batches with its own sampler, which the privacy accounting assumes")
    if isinstance(split, IterableDataset) or not (hasattr(split, "__len__") and hasattr(split, "__getitem__")):
        raise UserError(f"{where} a {type(split).__name__} without __len__ and __getitem__; dpbench needs a map-style "
                        "dataset of known size (e.g. torch.utils.data.TensorDataset) to sample it privately")
    if len(split) == 0:
        raise UserError(f"{where} empty")


def _class_index(label, i: int, where: str) -> int:
    """A label as a class index: an integer, or a float with no fractional part (2.0); one line
    otherwise (int(0.3) would silently make it class 0). The line names the item, never its value."""
    if hasattr(label, "item") and getattr(label, "ndim", 0) == 0:  # a 0-d tensor or numpy scalar
        label = label.item()
    if isinstance(label, numbers.Integral):
        return int(label)
    if isinstance(label, numbers.Real) and float(label).is_integer():
        return int(label)
    kind = ("a number with a fractional part" if isinstance(label, numbers.Real)
            else f"a {type(label).__name__}" + (f" of shape {tuple(label.shape)}" if hasattr(label, "shape") else ""))
    raise UserError(f"{where} labelled with {kind} at item {i}; labels must be class indices 0..num_classes-1 "
                    "(integers, or floats such as 2.0): map each class to its index in the builder")


def _tensors(split, which: str, path: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split as (inputs [N, ...] float32, or int64 where every input is a signed integer tensor,
    labels [N] int64), or one line saying what is wrong."""
    where = f"dataset.builder={path}: {which} is"
    check_map_style(split, where)
    inputs, labels = [], []
    for i in range(len(split)):
        item = split[i]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UserError(f"{where} not a dataset of (x, y) pairs: item {i} is a {type(item).__name__}")
        inputs.append(torch.as_tensor(item[0]))
        labels.append(_class_index(item[1], i, where))
    shapes = {tuple(x.shape) for x in inputs}
    if len(shapes) > 1:
        raise UserError(f"{where} inputs of several shapes {sorted(shapes)[:3]}; give every example one shape")
    tokens = all(x.dtype in TOKEN_DTYPES for x in inputs)  # token ids for an embedding: kept as integers
    inputs = [x.long() if tokens else x.float() for x in inputs]
    y = torch.tensor(labels, dtype=torch.long)
    if int(y.min()) < 0 or int(y.max()) >= num_classes:  # a malformed split: refused before training
        raise UserError(f"{where} labels outside 0..num_classes-1 = 0..{num_classes - 1}; fix num_classes or the labels")
    x = torch.stack(inputs)
    return (x if x.dim() > 1 else x[:, None]), y

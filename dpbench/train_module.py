"""Train a user's `nn.Module` from Python with any dpbench algorithm and accountant: the habit of
Opacus's `make_private`, in dpbench's terms (docs/bring-your-own.md, "From Python").

    results = dpbench.api.train_module(model, train, test, num_classes=3,
                                       overrides=["algo=grape", "privacy.epsilon=3", "logger=none"])

It is the config route with the objects handed over in memory: `model=custom` and `dataset=custom`
whose builders (below) return what the caller passed, so the same checks run (map-style data of
known size, the per-example checks of dpbench/models/user_checks.py) and the same sampler draws
the batches. The module is trained in place, as `make_private`'s is. A loss, if given, must be
per-example (`reduction='none'`): `(outputs, labels) -> Tensor[B]`, checked on every batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from dpbench.errors import UserError


@dataclass
class _Handed:
    model: nn.Module
    data: dict
    loss: Callable | None


_HANDED: list[_Handed] = []  # the call in progress (one at a time: a run is not re-entrant)


def _current() -> _Handed:
    if not _HANDED:
        raise UserError("this run's model and data were handed over by dpbench.api.train_module, which has returned; "
                        "load the saved weights (model.safetensors) into your own module instead")
    return _HANDED[-1]


def handed_model(model_cfg, spec) -> nn.Module:
    """The `model.builder` of train_module's runs: the caller's module itself."""
    return _current().model


def handed_data(dataset_cfg, seed: int) -> dict:
    """The `dataset.builder` of train_module's runs: the caller's datasets."""
    return _current().data


def handed_loss(outputs, labels):
    """The `dataset.loss` of train_module's runs: the caller's per-example loss."""
    return _current().loss(outputs, labels)


def _patterns(key: str, patterns: Sequence[str] | None) -> list[str]:
    return [] if patterns is None else [f"model.{key}=[{','.join(json.dumps(str(p)) for p in patterns)}]"]


def train_module(model: nn.Module, train: Any, test: Any, *, num_classes: int, overrides: Sequence[str] = (),
                 loss: Callable | None = None, trained_modules: Sequence[str] | None = None,
                 projected_modules: Sequence[str] | None = None, lora_targets: Sequence[str] | None = None,
                 name: str = "module", run_dir: str | Path | None = None, show_progress: bool = True,
                 quiet: bool = False):
    """Train `model` on `train` (map-style, (x, y) pairs) with the algorithm, accountant and
    settings of `overrides` (`dpbench` command-line overrides), evaluate on `test`, and return the
    run's `RunResults`. `trained_modules` / `projected_modules` / `lora_targets`: the family facts
    of a model config (fnmatch patterns of module names; docs/bring-your-own.md). A DataLoader, an
    IterableDataset or data without a length, a `model=`/`dataset=` override, or a loss that is not
    per-example is refused with a one-line `UserError`."""
    from dpbench.api import run
    from dpbench.data.user import check_map_style

    if not isinstance(model, nn.Module):
        raise UserError(f"train_module: model must be a torch.nn.Module, got a {type(model).__name__}")
    for which, split in (("train", train), ("test", test)):
        check_map_style(split, f"train_module: {which} is")
    taken = [o for o in overrides if o.lstrip("+~").split("=")[0] in ("model", "dataset")]
    if taken:
        raise UserError(f"train_module trains the model and data it is given; leave {', '.join(taken)} out of overrides")
    handed = [
        "model=custom", f"model.builder={__name__}:handed_model", f"model.name={name}",
        *_patterns("trained_modules", trained_modules), *_patterns("projected_modules", projected_modules),
        *_patterns("lora_targets", lora_targets),
        "dataset=custom", f"dataset.builder={__name__}:handed_data",
        *([f"dataset.loss={__name__}:handed_loss"] if loss is not None else []),
    ]
    _HANDED.append(_Handed(model, {"train": train, "test": test, "num_classes": num_classes}, loss))
    try:
        return run([*handed, *overrides], run_dir=run_dir, show_progress=show_progress, quiet=quiet)
    finally:
        _HANDED.pop()

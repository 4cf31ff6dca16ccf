"""The objects `dpbench.api.train_module` hands to the config route in memory: `model=custom` and
`dataset=custom` with the builders below, which return what the caller passed, so the same checks
run (map-style data of known size, the per-example checks of dpbench/models/user_checks.py) and
dpbench's own sampler draws the batches."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

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


def handed_overrides(name: str, loss: bool, trained_modules=None, projected_modules=None, lora_targets=None) -> list[str]:
    """The overrides that point a run's model and dataset (and loss) at the handed objects."""
    return [
        "model=custom", f"model.builder={__name__}:handed_model", f"model.name={name}",
        *_patterns("trained_modules", trained_modules), *_patterns("projected_modules", projected_modules),
        *_patterns("lora_targets", lora_targets),
        "dataset=custom", f"dataset.builder={__name__}:handed_data",
        *([f"dataset.loss={__name__}:handed_loss"] if loss else []),
    ]


def trainable_copy(model: nn.Module) -> nn.Module:
    """The copy of a caller's module that a train_module run trains (its hooks, per-example
    attributes, LoRA layers and frozen flags stay on the copy)."""
    import copy

    try:
        return copy.deepcopy(model)
    except Exception as error:  # noqa: BLE001 - whatever the module holds that cannot be copied
        raise UserError(f"train_module trains a copy of the module and loads its weights back, and "
                        f"copy.deepcopy({type(model).__name__}) failed: {type(error).__name__}: {error}") from error


def load_trained_weights(model: nn.Module, trained: nn.Module) -> None:
    """The trained copy's parameters and buffers into the caller's module, in its own devices and
    dtypes; LoRA adapters (peft layers injected by algo=lora/dplora) are merged into their base layers
    first, so the module keeps its own layers."""
    import sys

    import torch

    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None)
    wrapped = []  # the names of the layers peft wrapped: "<name>.base_layer.*" is the layer's own "<name>.*"
    for name, module in trained.named_modules() if tuner is not None else ():
        if isinstance(module, tuner):
            module.merge()
            wrapped.append(f"{name}." if name else "")
    state = {}
    for key, value in trained.state_dict().items():
        prefix = next((p for p in sorted(wrapped, key=len, reverse=True) if key.startswith(p)), None)
        if prefix is not None:
            rest = key[len(prefix):]
            if not rest.startswith("base_layer."):
                continue  # an adapter's own weights (lora_A, lora_B, ...): merged into the layer above
            key = prefix + rest[len("base_layer."):]
        state[key] = value
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


@contextlib.contextmanager
def handed(model: nn.Module, train, test, num_classes: int, loss: Callable | None) -> Iterator[None]:
    """The objects the builders above return while the block runs."""
    _HANDED.append(_Handed(model, {"train": train, "test": test, "num_classes": num_classes}, loss))
    try:
        yield
    finally:
        _HANDED.pop()

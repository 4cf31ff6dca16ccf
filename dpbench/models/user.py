"""A researcher's own model, built by import path with no edit to dpbench (the `_target_` habit of
Hydra apps): `model.builder=package.module:function`, called as `(model_cfg, DataSpec) -> nn.Module`
like dpbench's registered builders. The config also carries the facts `ModelFamily` keeps for
dpbench's own models (which Linear layers DP-GRAPE / GaLore project, LoRA's targets, the head that
`train.head_lr_scale` scales), so that every algorithm reads them with `family_of` as usual: the
model is registered under its `model.name` when it is built.

conf/model/custom.yaml is the empty form (`model=custom model.builder=...`); a user's own
`<dir>/model/<name>.yaml`, found through `hydra.searchpath`, is the same keys (docs/bring-your-own.md).
"""

from __future__ import annotations

import functools
import importlib
from fnmatch import fnmatchcase
from typing import Any, Callable

from torch import nn

from dpbench.errors import UserError

BUILDER_KEY = "builder"  # a model or dataset config naming its builder by import path
SIGNATURES = {"model": "(model_cfg, spec) -> torch.nn.Module",
              "dataset": "(dataset_cfg, seed) -> an object with train, test (map-style datasets) and num_classes"}
_USER_MODELS: set[str] = set()  # names registered from a user's config (re-registered on every build)


def names_builder(node) -> bool:
    """Whether a `model` or `dataset` config is a user's: it has a `builder` key (set or ???)."""
    return node is not None and BUILDER_KEY in node.keys()  # `in node` is False for a ??? value


def import_object(path: str, key: str) -> Callable[..., Any]:
    """The callable `package.module:attribute` names; one line naming `key`, the path and the fix
    where it does not resolve."""
    text = str(path)
    module_name, colon, attribute = text.partition(":")
    if not colon or not module_name or not attribute:
        raise UserError(f"{key}={text!r} is not an import path; write it as package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UserError(f"{key}={text}: cannot import {error.name or module_name}; put the folder that holds "
                        f"{module_name.split('.')[0]} on PYTHONPATH (or pip install it)") from None
    except Exception as error:  # the user's module raised while importing: its message, on one line
        raise UserError(f"{key}={text}: importing {module_name} failed: {type(error).__name__}: "
                        f"{' '.join(str(error).split())}") from None
    try:
        found = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise UserError(f"{key}={text}: {module_name} has no {attribute}; check the name after the colon") from None
    if not callable(found):
        raise UserError(f"{key}={text} is a {type(found).__name__}, not a function or class")
    return found


def builder_of(node, group: str) -> Callable[..., Any]:
    """The builder a user's `model` or `dataset` config names, imported; one line where it is
    unset (???) or does not import."""
    if not node.get(BUILDER_KEY):  # ??? (conf/model/custom.yaml) or null
        raise UserError(f"{group}={node.get('name')} needs {group}.builder=package.module:function, "
                        f"called as {SIGNATURES[group]} (docs/bring-your-own.md)")
    return import_object(node[BUILDER_KEY], f"{group}.builder")


def check_builders(cfg) -> None:
    """Every user builder the config names imports: one line naming it and the fix, before any work."""
    for group in ("model", "dataset"):
        if names_builder(cfg.get(group)):
            builder_of(cfg[group], group)


def _patterns(model_cfg, key: str) -> tuple[str, ...] | None:
    value = model_cfg.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def _matches(name: str, patterns) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def user_family(model_cfg, model: nn.Module):
    """The family record of a user's model from its config. Unset (null): the head is nothing,
    DP-GRAPE / GaLore project and LoRA adapts every nn.Linear outside the head. A pattern that
    matches no module is refused in one line (a typo would silently train something else)."""
    from dpbench.models import ModelFamily

    names = [n for n, _ in model.named_modules() if n]
    trained = _patterns(model_cfg, "trained_modules") or ()
    linear = tuple(n for n, m in model.named_modules()
                   if n and isinstance(m, nn.Linear) and not any(_matches(n, [p, f"{p}.*"]) for p in trained))
    projected = _patterns(model_cfg, "projected_modules")
    lora = _patterns(model_cfg, "lora_targets")
    for key, patterns in (("trained_modules", trained), ("projected_modules", projected or ()),
                          ("lora_targets", lora or ())):
        for pattern in patterns:
            if not any(_matches(n, [pattern]) for n in names):
                shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
                raise UserError(f"model.{key}: {pattern!r} matches no module of model={model_cfg.name} "
                                f"(its modules: {shown})")
    return ModelFamily(projected_modules=linear if projected is None else projected,
                       lora_targets=linear if lora is None else lora, trained_modules=trained)


def build_user_model(model_cfg, spec) -> nn.Module:
    """The user's builder, its result checked, registered under `model.name` with its family."""
    from dpbench.models import MODELS, RegisteredModel, apply_opacus_fixes

    name = str(model_cfg.get("name") or "custom")
    if name in MODELS.names() and name not in _USER_MODELS:
        raise UserError(f"model.name={name} is one of dpbench's models; give your model another model.name")
    builder = builder_of(model_cfg, "model")
    model = builder(model_cfg, spec)
    if not isinstance(model, nn.Module):
        raise UserError(f"model.builder={model_cfg[BUILDER_KEY]} returned a {type(model).__name__}; "
                        f"it must return a torch.nn.Module, called as {SIGNATURES['model']}")
    MODELS.unregister(name)  # the same name may be built again with other facts (a grid, a notebook)
    MODELS.register(name)(RegisteredModel(builder, user_family(model_cfg, model)))
    _USER_MODELS.add(name)
    return apply_opacus_fixes(model, name)

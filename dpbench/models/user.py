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
from pathlib import Path
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


def _where_raised(error: BaseException, package: str | None) -> str:
    """file:line where `error` was raised: the innermost frame in `package`'s files (the user's own
    code rather than torch's), else the innermost frame (an error in the package's own code)."""
    import sys
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    module = sys.modules.get(package or "")
    folder = str(Path(module.__file__).parent) if getattr(module, "__file__", None) else None
    own = [f for f in frames if folder and f.filename.startswith(folder)]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


def user_failure(error: BaseException, what: str, package: str | None, fix: str, where: str | None = None) -> UserError:
    """An exception raised in a user's code, as one line: `what` failed, the exception, where, and the fix."""
    message = " ".join(str(error).split())
    where = where or f"at {_where_raised(error, package)}"
    return UserError(f"{what} failed: {type(error).__name__}: {message[:300]} ({where}); {fix}")


def call_builder(builder: Callable[..., Any], node, group: str, *args) -> Any:
    """The user's builder called; an exception it raises is one line naming the builder and where it was raised."""
    try:
        return builder(*args)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code: its message, on one line
        path = str(node[BUILDER_KEY])
        raise user_failure(error, f"{group}.builder={path}", path.partition(":")[0].split(".")[0],
                           f"fix the builder there (it is called as {SIGNATURES[group]})") from None


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
    model = call_builder(builder, model_cfg, "model", model_cfg, spec)
    if not isinstance(model, nn.Module):
        raise UserError(f"model.builder={model_cfg[BUILDER_KEY]} returned a {type(model).__name__}; "
                        f"it must return a torch.nn.Module, called as {SIGNATURES['model']}")
    MODELS.unregister(name)  # the same name may be built again with other facts (a grid, a notebook)
    MODELS.register(name)(RegisteredModel(builder, user_family(model_cfg, model)))
    _USER_MODELS.add(name)
    return apply_opacus_fixes(model, name)


def forward_of(model: nn.Module, inputs):
    """`model(inputs)`, as a classification task calls a model. A Hugging Face BERT on token ids gets
    position ids per example ([B, T], as model=bert passes them): BertEmbeddings' own are one shared
    [1, T] row, which a per-example engine would read as one example's (the layout probe refuses it)."""
    if (type(model).__module__.startswith("transformers.") and getattr(model.config, "model_type", None) == "bert"
            and not inputs.is_floating_point()):
        import torch

        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        return model(inputs, position_ids=positions, token_type_ids=torch.zeros_like(inputs))
    return model(inputs)


def logits_of(output):
    """A classifier's logits from what its forward returned: the tensor itself, or the `.logits` of
    a Hugging Face ModelOutput (BertForSequenceClassification and its kind); anything else as it is."""
    logits = getattr(output, "logits", None)
    return output if logits is None or not hasattr(logits, "shape") else logits


def _described(batch) -> str:
    """What the model is given, as a message says it: shape and dtype of the input tensor(s)."""
    import torch

    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    tensors = first.values() if isinstance(first, dict) else [first]
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors if torch.is_tensor(t))


def _pop(entered: list) -> None:  # a forward hook's return value would replace the layer's output
    if entered:
        entered.pop()


def check_first_forward(cfg, task, model: nn.Module) -> None:
    """Before any work, where a user's model or data is involved: one forward of the model on the first
    training example and its loss. An exception in the model or the loss, an output that is not a tensor,
    or a classifier output that is not [1, num_classes] is one line naming the model and the fix (a wrong
    output count would otherwise train silently while every label is below it). The model is left as it
    was: eval mode (no dropout draw, no running statistic), no gradient, buffers restored."""
    import torch

    if not (names_builder(cfg.get("model")) or names_builder(cfg.get("dataset"))):
        return
    name = f"model={cfg.model.get('name')}"
    given = cfg.model.get(BUILDER_KEY) if names_builder(cfg.model) else None
    package = str(given).partition(":")[0].split(".")[0] if given else type(model).__module__.split(".")[0]
    batch = task.batch([0])
    shown = _described(batch)
    outputs: list = []
    entered: list[str] = []  # the layers whose forward began and has not returned: the last one raised
    hooks = [model.register_forward_hook(lambda module, args, output: outputs.append(output))]
    for layer, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda module, args, layer=layer: entered.append(layer)))
        hooks.append(module.register_forward_hook(lambda module, args, output: _pop(entered)))
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = task.per_sample_loss(model, batch)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's model or data: one line
        if not outputs:  # raised inside the forward: mostly a first layer that does not fit the input
            inner = [n for n in entered if n]
            layer = inner[-1] if inner else None
            where = (f"in layer {layer} ({type(model.get_submodule(layer)).__name__})"
                     if layer and type(model.get_submodule(layer)).__module__.startswith("torch.") else None)
            tokens = "; integer inputs stay integers (token ids): give others as floats" if "int" in shown else ""
            raise user_failure(error, f"{name}: its forward on one training example (input {shown})", package,
                               "make the model's first layer take that input (the builder gets it as "
                               f"spec.input_shape) or fix the data{tokens}", where) from None
        output = logits_of(outputs[0])
        if not torch.is_tensor(output):  # the loss could not read it
            raise UserError(f"{name}: its forward returned a {type(output).__name__}; it must return the logits, "
                            f"a tensor of shape (batch, num_classes)") from None
        raise user_failure(error, f"{name}: the loss of its output {tuple(output.shape)} on one training example",
                           package, "return logits of shape (batch, num_classes)") from None
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
    output = logits_of(outputs[0]) if outputs else None
    if output is not None and not torch.is_tensor(output):
        raise UserError(f"{name}: its forward returned a {type(output).__name__}; it must return the logits, "
                        "a tensor of shape (batch, num_classes)")
    spec = task.model_spec() if hasattr(task, "model_spec") else None
    classes = getattr(spec, "num_classes", None)
    if (output is not None and classes and getattr(task, "user_loss", None) is None
            and tuple(output.shape) != (1, int(classes))):
        raise UserError(f"{name}: its forward on one training example (input {shown}) returned shape "
                        f"{tuple(output.shape)}, not (1, {classes}) (batch, num_classes={classes}); give the last layer "
                        "spec.num_classes outputs")
    if torch.is_tensor(losses) and losses.shape != (1,):
        raise UserError(f"{name}: the loss of one training example has shape {tuple(losses.shape)}, not (1,); "
                        "return logits of shape (batch, num_classes)")

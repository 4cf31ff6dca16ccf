"""Model builders, by name (`model=...`), each registered with its family record.

A builder takes the model config and a DataSpec. Beside it, `register_model` keeps one
`ModelFamily` record (as timm keeps `default_cfgs` beside its builders): the facts algorithms and
tasks need about the model (which layers DP-GRAPE/GaLore project, LoRA's targets, the head that
stays trained, the language task it runs). Adding a model is one file in this package (found on
the first lookup, see dpbench/registry.py) plus conf/model/<name>.yaml; nothing else names it.
A user's model outside the package names its builder by import path instead (`model.builder`,
with the family's facts in its config: dpbench/models/user.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from dpbench.errors import UserError
from dpbench.registry import Registry


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about the task's inputs and outputs."""

    num_classes: int
    channels: int = 1
    image_size: int = 8
    patch_size: int = 2  # the dataset's ViT patch size (image_size / patch_size tokens per side)
    input_shape: tuple[int, ...] = ()  # one example's input shape (a user's model reads it; () where unknown)


def _unchanged(model: nn.Module) -> nn.Module:
    return model


@dataclass(frozen=True)
class OpacusFix:
    """A change that makes a model's modules fit Opacus's per-module grad samplers, applied after
    the builder; `undo` restores the original modules (for save_pretrained)."""

    apply: Callable[[nn.Module], nn.Module]
    undo: Callable[[nn.Module], nn.Module] = _unchanged


@dataclass(frozen=True)
class ModelFamily:
    """What algorithms and tasks read about a model instead of keeping their own tables."""

    # fnmatch patterns (`*` also matches dots) of the Linear layers DP-GRAPE / GaLore project:
    # those inside transformer blocks (embeddings, heads, norms and biases stay full).
    projected_modules: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ()  # module names LoRA adapts unless algo.target_modules is set
    trained_modules: tuple[str, ...] = ()  # stay trainable beside LoRA adapters (a fresh head)
    # The task kind `dataset.task: language` runs as with this model; None: not a language model.
    language_task: str | None = None
    # Transformers' `config.model_type` of this family, so that a Hugging Face model built
    # outside dpbench is recognised too; None for non-Hugging-Face models.
    model_type: str | None = None
    opacus_fixes: tuple[OpacusFix, ...] = ()
    # fnmatch patterns of the transformer blocks `train.sharding=fsdp` wraps one by one (the
    # outermost modules they match; dpbench/runtime/sharding.py); () : the family cannot be sharded.
    block_modules: tuple[str, ...] = ()
    # Libraries its builder imports when it runs: imported before a job's memory is metered
    # (dpbench/runtime/warmup.py), so the first job of a process does not pay for them alone.
    libraries: tuple[str, ...] = ()
    # Whether the head can start from the encoder's features of the data set's label descriptions
    # (model.head_init=zero_shot, dpbench/models/zero_shot_head.py); False: refused in one line.
    zero_shot_head: bool = False


@dataclass(frozen=True)
class RegisteredModel:
    """One registry entry: the builder `(model_cfg, DataSpec) -> nn.Module` and its family record."""

    build: Callable[..., nn.Module]
    family: ModelFamily


MODELS: Registry[RegisteredModel] = Registry("model", package=__name__)
FAMILY_ATTRIBUTE = "dpbench_family"  # set on every model dpbench builds: its registered name
# True on a registered model built from its config and the seed alone (no checkpoint, asset or
# pretrained weights): zeroth-order algo.mode=auto reads it (algorithms/dpzero.py)
FROM_SCRATCH_ATTRIBUTE = "dpbench_from_scratch"
CHECKPOINT_KEYS = ("path", "asset", "pretrained")  # model config keys that load weights


def register_model(name: str, family: ModelFamily = ModelFamily()) -> Callable:
    """Decorator: register a builder `(model_cfg, DataSpec) -> nn.Module` with its family record."""

    def decorator(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        MODELS.register(name)(RegisteredModel(builder, family))
        return builder

    return decorator


def build_model(model_cfg, spec: DataSpec) -> nn.Module:
    """The registered builder of `model.name`, then the family's Opacus fixes (a user's builder by
    import path: `Task.build_model` dispatches to dpbench/models/user.py)."""
    model = apply_opacus_fixes(MODELS.get(model_cfg.name).build(model_cfg, spec), model_cfg.name)
    # a language family always loads a checkpoint (model.path or the hub's)
    from_scratch = model_family(model_cfg.name).language_task is None and not any(
        model_cfg.get(key) for key in CHECKPOINT_KEYS)
    setattr(model, FROM_SCRATCH_ATTRIBUTE, from_scratch)
    return model


def apply_opacus_fixes(model: nn.Module, name: str) -> nn.Module:
    """The family's Opacus fixes, then the family's name on the model (read by `family_of`)."""
    for fix in model_family(name).opacus_fixes:
        model = fix.apply(model)
    setattr(model, FAMILY_ATTRIBUTE, name)  # a plain attribute: survives .to() and peft injection
    return model


def model_family(name: str) -> ModelFamily:
    return MODELS.get(name).family


def family_of(model: nn.Module) -> ModelFamily | None:
    """The record of a model: the one it was built with, or its Hugging Face model_type's."""
    name = getattr(model, FAMILY_ATTRIBUTE, None)
    if name is not None:
        return model_family(name)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    return next((f for f in map(model_family, MODELS.names()) if f.model_type == model_type), None)


def default_projected_modules(model: nn.Module) -> tuple[str, ...]:
    """The model's family patterns; a model built outside the registry gets every family's."""
    family = family_of(model)
    if family is not None:
        return family.projected_modules
    return tuple(p for name in MODELS.names() for p in model_family(name).projected_modules)


def language_families() -> list[str]:
    return [name for name in MODELS.names() if model_family(name).language_task]


def language_family(name: str) -> ModelFamily:
    """The record of language model `name`, or a one-line error listing the language models."""
    family = model_family(name)
    if family.language_task is None:
        choices = " or ".join(f"model={n}" for n in language_families())
        raise UserError(f"model={name} is not a language model; use {choices}")
    return family

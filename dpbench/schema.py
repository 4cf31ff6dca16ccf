"""Typed schema of dpbench's config: Hydra structured configs as the schema of the YAML in conf/.

The YAML files stay what users read and edit (defaults and comments live there); each names its
schema first in its defaults list (`- /algo_grape_schema@_here_`, then `- _self_`). Hydra then
checks every value against the dataclasses while it composes: an integer key rejects 1.5, a
number rejects "abc", a choice rejects what it does not list, an undeclared key cannot be set
(algorithm options: see `register`). A key the YAML omits takes the dataclass default; code
receives typed values and casts nothing. A rejected value reaches the user as one line
(`run_app`, `checked_composition`).

Here: the top level (privacy, train, audit, ...) and the machinery. An algorithm's options live
in its own file, registered with its class (`@ALGORITHMS.register("grape", options=GrapeOptions)`,
a dataclass deriving from `AlgoOptions`); `register` stores every registered algorithm's options
as `algo_<name>_schema`. Adding an algorithm is therefore its file in dpbench/algorithms/ and its
conf/algo/<name>.yaml, nothing here. Choices are generated from the registry they select from
(`Clipping` from the clipping rules, `AccountantName` from the accountants, ...), so a new entry
is a new choice; hand-written choices remain only where no registry exists.

Datasets and models are not typed: their options differ per family (image sizes, hub names,
tokenizer lengths, CNN widths) and each builder checks its own; their registries carry no
options. So a user's own `model/<name>.yaml` or `dataset/<name>.yaml` on Hydra's search path, with
its `builder: package.module:function` and keys of its own, composes as it is (dpbench/models/user.py). Accountants have no options beyond their name (a choice of the accountant registry).

Adding a key to conf/config.yaml: a field here as well; to conf/algo/<name>.yaml: a field of
that algorithm's options dataclass.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import typing
from typing import Any, Callable, Iterator

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from dpbench.algorithms import ALGORITHMS
from dpbench.errors import UserError
from dpbench.startup import missing_option_message  # torch-free: the console script answers `algo=grpae` first

# The option vocabulary lives in dpbench/options.py (a leaf the algorithms import); re-exported
# here for one release for code that imported it from dpbench.schema.
from dpbench.options import (  # noqa: F401
    Choice,
    choice_of,
    Clipping,
    AccountantName,
    Neighboring,
    PrecisionName,
    Sampling,
    Device,
    WandbMode,
    ReportMetric,
    PrivacyOptions,
    TrainOptions,
    AuditOptions,
    ReportOptions,
    AccountantOptions,
    LoggerOptions,
    WandbOptions,
    AlgoOptions,
    Config,
)


# ---------------------------------------------------------------------------- the ConfigStore


def algo_schemas() -> dict[str, type[AlgoOptions]]:
    """Algorithm name -> its options dataclass, as registered with the class (dpbench/algorithms/);
    conf/algo/<name>.yaml names `algo_<name>_schema` in its defaults list."""
    schemas = {}
    for name in ALGORITHMS.names():
        options = ALGORITHMS.options(name)
        if not (isinstance(options, type) and issubclass(options, AlgoOptions)):
            raise TypeError(f"algorithm {name!r} needs its options: @ALGORITHMS.register({name!r}, "
                            "options=<a dataclass deriving from dpbench.options.AlgoOptions>)")
        schemas[name] = options
    return schemas


def schemas() -> dict[str, type]:
    """ConfigStore name -> schema. Stored outside any config group, so they are not offered as
    options (`dpbench --help`, `algo=...`); the YAML files reach them by absolute path."""
    return {
        "config_schema": Config,
        "accountant_schema": AccountantOptions,
        "logger_none_schema": LoggerOptions,
        "logger_wandb_schema": WandbOptions,
        **{f"algo_{name}_schema": schema for name, schema in algo_schemas().items()},
    }


# Config keys that change neither what a run computes nor where it lives: a stored run that
# differs only in these is reused on resume, and a grid's job folder names leave them out
# (conf/config.yaml's override_dirname.exclude_keys reads them through `excluded_from_dirname`).
RUN_INVARIANT_KEYS = ("logger", "resume", "name", "audit", "threads", "optimize", "train.checkpoint_every",
                      "train.checkpoint", "train.save_model")
# Keys that only supply other keys' values by interpolation (conf/config.yaml, a preset's lookup
# tables and their labels): what they decide is compared where it lands (train.*, privacy.clip_norm,
# algo.*), so resume matches and the report averages runs made before they existed (or changed).
DEFAULT_SUPPLIERS = ("algo.default_lr", "algo.lr_family", "algo.default_clip_norm", "algo.default_steps",
                     "algo.default_batch_size", "dataset.train_defaults", "paper_setting")
# Keys added since runs were stored whose new default is not what those runs did: the value a stored
# run without the key ran with (zeroth-order runs perturbed every weight before algo.mode existed)
PREDATING_VALUES = {"algo.mode": "full", "model.head_init": "random"}
# Keys read only where another key has a value (the label descriptions build a zero-shot head and
# nothing else): elsewhere resume and the report leave them out, so runs made before they existed match.
USED_ONLY_WITH = {"dataset.label_descriptions": ("model.head_init", "zero_shot")}


def excluded_from_dirname() -> list[str]:
    """RUN_INVARIANT_KEYS as Hydra's override_dirname matches them: whole keys, so a section's
    own keys (`logger.mode=online`, `audit.trials=3`) are listed one by one."""
    sections = {"logger": WandbOptions, "audit": AuditOptions}
    keys = []
    for key in RUN_INVARIANT_KEYS:
        keys.append(key)
        if key in sections:
            keys += [f"{key}.{field.name}" for field in dataclasses.fields(sections[key])]
    return keys


def default_learning_rate(dataset_lr, lr_family: str, algo_lr: float) -> float:
    """train.lr when the command line gives none: a data set's train_defaults.lr (one rate for every
    algorithm, or a map from lr family to rate) where it has one for this algorithm's family, else
    the algorithm's own default_lr (conf/config.yaml)."""
    if dataset_lr is None:
        return float(algo_lr)
    if isinstance(dataset_lr, (int, float)):
        return float(dataset_lr)
    rate = dataset_lr.get(str(lr_family))
    return float(algo_lr if rate is None else rate)


def default_head_init(dataset_head_init, lr_family: str) -> str:
    """model.head_init when the command line gives none: a data set's train_defaults.head_init (one
    choice for every algorithm, or a map from lr family to choice, decided on a validation part) where
    it has one for this algorithm's family, else `random` (a fresh head)."""
    if dataset_head_init is None:
        return "random"
    if isinstance(dataset_head_init, str):
        return dataset_head_init
    return str(dataset_head_init.get(str(lr_family)) or "random")


def default_batch_size(dataset_batch, algo_batch) -> int:
    """train.batch_size when the command line gives none: the data set's, the algorithm's, else 256."""
    return int(next((b for b in (dataset_batch, algo_batch) if b is not None), 256))


def default_epochs(dataset_epochs, algo_steps) -> float | None:
    """train.epochs when the command line gives none: the data set's train_defaults.epochs, else
    none where the algorithm declares default_steps (train.steps then applies), else 30."""
    if dataset_epochs is not None:
        return float(dataset_epochs)
    return None if algo_steps is not None else 30.0


def default_steps(epochs, algo_steps) -> int | None:
    """train.steps when the command line gives none: the algorithm's default_steps, only where no
    epochs were given (a typed train.epochs wins over an algorithm's default)."""
    return None if epochs is not None or algo_steps is None else int(algo_steps)


_ABSENT = object()
# the table entries `preset_setting` found absent while `preset_fallbacks` resolves (None: not collecting)
_FALLBACKS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("dpbench_setting_fallbacks", default=None)


def preset_setting(entry: str, fallback: Any, *, _root_: DictConfig) -> Any:
    """`${dpbench_setting:paper_setting.lr.${algo.name},<fallback>}`: a preset's setting looked up in
    its table by the algorithm (or data set, or size): the table's value, else `fallback`, the
    algorithm's own default, so that a preset runs an algorithm its table does not list (a run note
    says so: `preset_fallbacks`). An entry with brackets (`[${model.size}]`) is quoted."""
    value = OmegaConf.select(_root_, entry, default=_ABSENT)
    if value is not _ABSENT:
        return value
    collected = _FALLBACKS.get()
    if collected is not None:
        collected.append(entry)
    return fallback


def preset_fallbacks(cfg: DictConfig) -> list[str]:
    """A note for each setting a preset's table did not hold for this run (`preset_setting`)."""
    notes = []
    for key in _keys_holding(OmegaConf.to_container(cfg, resolve=False), "${dpbench_setting:"):
        collected: list[str] = []
        token = _FALLBACKS.set(collected)
        try:
            value = OmegaConf.select(cfg, key)
        finally:
            _FALLBACKS.reset(token)
        shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        shown = "null" if shown is None else shown
        notes += [f"{key}={shown}: the preset has no {entry}, so algo={cfg.algo.name} runs at its own default"
                  for entry in dict.fromkeys(collected)]
    return notes


def _keys_holding(node: Any, text: str, prefix: str = "") -> Iterator[str]:
    """The dotted keys of the unresolved container `node` whose value contains `text`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _keys_holding(value, text, f"{prefix}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _keys_holding(value, text, f"{prefix.removesuffix('.')}[{index}].")
    elif isinstance(node, str) and text in node:
        yield prefix.removesuffix(".")


def option_default(algo_name: str, option: str) -> Any:
    """`${dpbench_option_default:${algo.name},rank}`: the default of the algorithm's option (its
    options dataclass), None where it has no such option: a preset's fallback for a key it sets."""
    options = ALGORITHMS.options(str(algo_name))
    field = next((f for f in dataclasses.fields(options) if f.name == option), None) if options else None
    if field is None:
        return None
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


_stored: dict[str, type] = {}  # ConfigStore entries this process stored, by name


def register() -> None:
    """Put the schemas in Hydra's ConfigStore; every entry point calls it before composing."""
    from hydra.core.config_store import ConfigStore

    # conf/config.yaml names a grid's job folders without the keys that do not change a run
    OmegaConf.register_new_resolver("dpbench_excluded_from_dirname", excluded_from_dirname, replace=True)
    OmegaConf.register_new_resolver("dpbench_default_lr", default_learning_rate, replace=True)
    OmegaConf.register_new_resolver("dpbench_default_batch_size", default_batch_size, replace=True)
    OmegaConf.register_new_resolver("dpbench_default_head_init", default_head_init, replace=True)
    OmegaConf.register_new_resolver("dpbench_default_epochs", default_epochs, replace=True)
    OmegaConf.register_new_resolver("dpbench_default_steps", default_steps, replace=True)
    OmegaConf.register_new_resolver("dpbench_setting", preset_setting, replace=True)  # presets' tables by algo.name
    OmegaConf.register_new_resolver("dpbench_option_default", option_default, replace=True)
    store = ConfigStore.instance()
    for name, schema in schemas().items():
        if _stored.get(name) is schema:
            continue  # stored by an earlier call (OmegaConf.structured is a fifth of a compose's time)
        _stored[name] = schema
        node = OmegaConf.structured(schema)
        if issubclass(schema, AlgoOptions):
            # Open to keys it does not declare: paper presets set options of some algorithms of
            # their grid for all of it (algo.rank=64 for grape and dpadam jobs alike). Its own
            # keys are still typed; `check_keys` rejects a key no algorithm declares.
            OmegaConf.set_struct(node, False)
        store.store(name=name, node=node)


# Keys every conf/dataset/*.yaml holds (datasets are untyped), with the default a stored run that
# predates them ran with (dpbench/data/validation.py reads it with this default).
DATASET_DEFAULTS = {"dataset.validation_fraction": 0.0}


def default_of(dotted: str, algo_name: str | None = None) -> Any:
    """The schema's default of a top-level or `algo.` key (MISSING where no schema declares one):
    resume treats a key that a stored run predates as matching when the run uses its default."""
    section, _, key = dotted.partition(".")
    if dotted in DATASET_DEFAULTS:  # untyped dataset configs: the keys every one of them has
        return DATASET_DEFAULTS[dotted]
    if section == "algo":
        schema = algo_schemas().get(algo_name or "")
        node = OmegaConf.structured(schema) if schema else None
    else:
        node, key = OmegaConf.structured(Config), dotted
    value = OmegaConf.select(node, key, default=MISSING, throw_on_missing=False) if node is not None else MISSING
    return str(value) if isinstance(value, Choice) else value


# ---------------------------------------------------------------------------- keys and errors


def _declared(schema: type) -> list[str]:
    """A schema's keys, an algorithm's own before the defaults every algorithm has (default_lr ...)."""
    names = [f.name for f in dataclasses.fields(schema)]
    if issubclass(schema, AlgoOptions):
        shared = [f.name for f in dataclasses.fields(AlgoOptions) if f.name != "name"]
        names = [n for n in names if n not in shared] + shared
    return names


def _undeclared(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted key, schema of its node) for every key a typed node holds but does not declare."""
    schema = OmegaConf.get_type(node)
    declared = _declared(schema)
    for key in node.keys():
        child = OmegaConf.get_type(node, key)
        if key not in declared:
            yield f"{prefix}{key}", schema
        elif isinstance(child, type) and dataclasses.is_dataclass(child):
            yield from _undeclared(node[key], f"{prefix}{key}.")


def check_keys(cfg: DictConfig) -> list[str]:
    """Reject a key no schema declares (`+privacy.typo=1`, `+algo.nonsense=1`: Hydra's `+` adds
    keys even to typed nodes). Returns notes for options of other algorithms, which this one ignores."""
    if not dataclasses.is_dataclass(OmegaConf.get_type(cfg)):
        return []  # not composed from conf/ (a hand-made config in a test)
    notes, algos = [], algo_schemas()
    for key, schema in _undeclared(cfg):
        option = key.removeprefix("algo.")
        users = ", ".join(name for name, s in algos.items() if option in _declared(s))
        if issubclass(schema, AlgoOptions) and users:
            notes.append(f"{key} is not an option of algo={cfg.algo.name} (it is one of {users}); ignored")
            continue
        where = f"algo={cfg.algo.name}" if issubclass(schema, AlgoOptions) else (key.rpartition(".")[0] or "the top level")
        raise UserError(f"{key} is not a known key; {where} takes: {', '.join(_declared(schema))}")
    return notes


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether null is allowed) of a field annotation such as Optional[int]."""
    args = typing.get_args(annotation)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return annotation, False


def _is_choice(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Choice)


KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a mapping"}


def _allowed(annotation: Any) -> str:
    """What a field accepts, as an error message says it."""
    kind, nullable = _unwrap(annotation)
    if _is_choice(kind):
        text = "one of " + ", ".join(kind.__members__)
    else:
        text = KIND_NAMES.get(typing.get_origin(kind) or kind, str(kind))
    return text + (" or null" if nullable else "")


def composition_error_message(error: BaseException) -> str | None:
    """One line (key, bad value, what is allowed) for a value or key the schema rejected while
    Hydra composed (the OmegaConf error is the cause of Hydra's); None for other errors (a
    missing config file, bad override grammar)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = error.__cause__
    schema = getattr(cause, "object_type", None)
    if not (dataclasses.is_dataclass(schema) and getattr(cause, "full_key", None)):
        return None
    if isinstance(cause, ValidationError):
        annotation = typing.get_type_hints(schema).get(str(cause.key), Any)
        if _is_choice(_unwrap(annotation)[0]):
            return f"{cause.full_key}={cause.value!r} is not known; use {_allowed(annotation)}"
        return f"{cause.full_key} must be {_allowed(annotation)}, got {cause.value!r}"
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return None
    where = cause.full_key.rpartition(".")[0] or "the top level"
    return f"{cause.full_key} is not a known key; {where} takes: {', '.join(_declared(schema))}"


def _user_error_within(error: BaseException) -> str | None:
    """dpbench's own one line when Hydra wrapped it (a plugin's UserError raised while Hydra
    instantiated it: "Error in call to target ...")."""
    seen = error
    for _ in range(8):  # the chain is short; a bound, in case of a cycle
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            return None
        if isinstance(seen, UserError):
            return str(seen)
    return None


def one_line(error: BaseException) -> str:
    """Any error of Hydra's composition as one line: the schema's wording, the "did you mean" of a
    missing option, or Hydra's own message with its lines joined."""
    from omegaconf.errors import OmegaConfBaseException

    message = composition_error_message(error) or missing_option_message(error) or _user_error_within(error)
    if message is None:
        cause = error.__cause__
        text = str(error) + (f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else "")
        # Hydra's grammar errors point at the column with a caret line: it means nothing once joined
        lines = [line.strip() for line in text.splitlines() if line.strip() and set(line.strip()) != {"^"}]
        message = "; ".join(lines)
        if message.startswith("LexerNoViableAltException: "):  # a character the override grammar reserves
            override = message.split(": ", 1)[1].split("; See ")[0]
            key, _, value = override.partition("=")
            message = (f"cannot parse the override {override}: quote a value with special characters "
                       f"(~ ' \" [ ] {{ }} ( ) , = or spaces), e.g. '{key}=\"{value}\"' (Hydra's override grammar)")
    return message


@contextlib.contextmanager
def checked_composition() -> Iterator[None]:
    """Around a call of Hydra's compose API: the schemas registered, and any composition error (a
    value or key the schema rejects, a missing option, bad override grammar) raised as a one-line
    UserError instead of Hydra's exception, as the console script reports it."""
    from hydra.errors import HydraException

    register()
    try:
        yield
    except HydraException as error:
        raise UserError(one_line(error)) from error


def run_app(app: Callable[[], Any]) -> Any:
    """Run a `@hydra.main` app with the schemas registered; a composition error ends as one line
    on stderr and exit status 2 (Hydra would print several lines and exit 1). Errors raised by
    the job itself are the app's to report."""
    from hydra.errors import HydraException

    from dpbench.preflight import Refused

    register()
    try:
        if os.environ.get("HYDRA_FULL_ERROR"):  # the user asked for Hydra's full stack traces
            return app()
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises its errors instead of printing them
        return app()
    except HydraException as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except Refused as refused:  # the machine checks before Hydra made a folder (dpbench.cli.Preflight)
        print(f"error: {refused.error}", file=sys.stderr)
        sys.exit(2)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)

"""What the console script settles before it imports torch: `dpbench --help`, Tab completion and a
config-group option that does not exist (`dpbench algo=grpae`) answer in well under 2 s.

dpbench/schema.py's typed schemas come from the registries (every algorithm's module, so torch).
Help, completion and the choice of a group's option read only the YAML in conf/ and which files
exist, so here Hydra composes with stand-ins under the schemas' ConfigStore names: empty, untyped
nodes. Anything the stand-ins cannot settle (a value the schema types, a resolver, `--cfg`, a run)
is left to the real composition, which says the same or more; nothing here refuses what it would
accept. Nothing in this module imports torch (tests/run/test_startup.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from dpbench.paths import config_dir

# `- config_schema` and `- /algo_grape_schema@_here_` in the defaults lists of conf/
_SCHEMA_REFERENCE = re.compile(r"^\s*-\s*/?(\w+_schema)(?:@\w+)?\s*(?:#.*)?$", re.MULTILINE)

_RESOLVER_REFERENCE = re.compile(r"\$\{(dpbench_\w+):")

OPTIONS_SHOWN = 20  # a group with more options (experiment) points to --help instead of listing them


def _referenced(pattern: re.Pattern) -> set[str]:
    names = set()
    for path in Path(config_dir()).rglob("*.yaml"):
        names.update(pattern.findall(path.read_text()))
    return names


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """An empty untyped node under each schema name the YAML in conf/ asks for (dpbench.schema.schemas()
    stores the real ones) and a resolver under each `${dpbench_...:}` it uses, where none is registered
    yet; removed again afterwards. The stand-in resolvers return an empty list: Hydra itself resolves
    only one while composing (hydra.job.config.override_dirname.exclude_keys, the keys a grid's folder
    names leave out), and help and completion print no other."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    repo = ConfigStore.instance().repo
    schemas = [name for name in sorted(_referenced(_SCHEMA_REFERENCE)) if f"{name}.yaml" not in repo]
    resolvers = [name for name in sorted(_referenced(_RESOLVER_REFERENCE)) if not OmegaConf.has_resolver(name)]
    for name in schemas:
        ConfigStore.instance().store(name=name, node=OmegaConf.create({}))
    for name in resolvers:
        OmegaConf.register_new_resolver(name, lambda *args: [])
    try:
        yield
    finally:
        for name in schemas:
            repo.pop(f"{name}.yaml", None)
        for name in resolvers:
            OmegaConf.clear_resolver(name)


def missing_option_message(error: BaseException) -> str | None:
    """One line for a config-group option that does not exist (`algo=grpae`,
    `hydra/sweeper=private_serch`): the closest option ("did you mean") and the group's options;
    None for other errors."""
    import difflib

    from hydra.errors import MissingConfigException

    if not isinstance(error, MissingConfigException) or not error.missing_cfg_file or error.options is None:
        return None
    group, _, name = str(error.missing_cfg_file).rpartition("/")
    if not group:
        return None
    close = difflib.get_close_matches(name, error.options, n=1, cutoff=0.6)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    listed = (", ".join(error.options) if len(error.options) <= OPTIONS_SHOWN
              else f"{len(error.options)} options, listed by `dpbench --help`")
    return f"{group}={name} is not an option of {group}{hint} ({group}: {listed})"


def answer_without_schemas(app: Callable[[], Any]) -> bool:
    """Run a `@hydra.main` app for `--help` or `--shell-completion` with the stand-ins; False (nothing
    printed) when they do not suffice, and the caller runs it again with the real schemas."""
    from hydra.core.global_hydra import GlobalHydra

    own_setting = "HYDRA_FULL_ERROR" not in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors instead of printing them
    try:
        with stand_ins():
            app()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return False
    except Exception:  # noqa: BLE001 - the real composition reports it
        return False
    finally:
        GlobalHydra.instance().clear()
        if own_setting:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    return True


def _points(parsed: list) -> list[list[str]] | None:
    """Command lines without sweeps that together select every option a grid's swept groups take:
    each sweep at its first value, then each further value of a swept group (a key without a dot)
    once. A value key's continuous sweep is left out (it selects no config); None where a group's
    options are not listed (a glob), which the real composition expands."""
    first, further = [], []
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            first.append(override.input_line)
            continue
        try:
            values = list(override.sweep_string_iterator()) if override.is_discrete_sweep() else None
        except Exception:  # noqa: BLE001 - glob(...): the options are the repository's
            values = None
        if not values:
            if "." not in key:
                return None
            continue
        first.append(f"{key}={values[0]}")
        if "." not in key:
            further += [(len(first) - 1, f"{key}={value}") for value in values[1:]]
    return [first] + [first[:i] + [line] + first[i + 1:] for i, line in further]


def missing_group_option(argv: list[str], calling_file: str) -> str | None:
    """The one line for a config-group option of the command line, of a grid's values or of a preset
    they select that does not exist, found by composing with the stand-ins; None when none is missing
    or the stand-ins cannot tell (the real composition then decides)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    try:
        args = get_args_parser().parse_args(argv)
        points = _points(OverridesParser.create().parse_overrides(args.overrides))
    except (Exception, SystemExit):  # noqa: BLE001 - bad flags or grammar: the real composition's message
        return None
    if points is None:
        return None
    search_path = create_automatic_config_search_path(calling_file, None, args.config_path or config_dir())
    if args.config_dir is not None:
        if not os.path.isdir(args.config_dir):
            return None
        search_path.prepend("command-line", f"file://{os.path.abspath(args.config_dir)}")
    with stand_ins():
        for overrides in points:
            try:
                hydra = Hydra.create_main_hydra2(task_name=Path(calling_file).stem, config_search_path=search_path)
                hydra.compose_config(args.config_name or "config", overrides, run_mode=RunMode.RUN,
                                     from_shell=True, with_log_configuration=False)
            except Exception as error:  # noqa: BLE001 - only a missing option is settled here
                message = missing_option_message(error) or missing_option_message(error.__cause__ or error)
                if message is not None:
                    return message
            finally:
                GlobalHydra.instance().clear()
    return None


def interrupted() -> None:
    """Ctrl-C while the console script starts (importing torch takes seconds): one line, exit 130."""
    print("interrupted while starting: nothing ran", file=sys.stderr)
    sys.exit(130)

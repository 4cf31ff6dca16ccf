"""A private study's search space and its studies: the sweep's overrides read with Hydra's parser
(`choice(...)`, `a,b,c`, `range(...)`: a choice; `interval(a, b)`: uniform; `tag(log, interval(a, b))`:
log-uniform; every other override fixed), a config's `search_space` added to them, and the folders
of a sweep's several studies (`hydra.sweeper.grid`, `hydra.sweeper.studies`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override

from dpbench.errors import UserError

# Swept keys that would change a trial's privacy event; the bound assumes every trial is the same
# mechanism. privacy.clip_norm only scales the clipped sum and its noise together: the ledger
# (noise multiplier, sample rate, steps) stays the same.
EVENT_KEYS = ("train.batch_size", "train.steps", "train.epochs")
EVENT_SECTIONS = ("privacy", "dataset", "experiment")  # the group or any of its keys
EVENT_FREE_KEYS = ("privacy.clip_norm",)
# results.json metrics computed from the private training data without noise: a study selecting
# on them releases more than the bound covers


def changes_event(key: str) -> bool:
    key = key.lstrip("+~").split("@")[0]
    if key in EVENT_FREE_KEYS:
        return False
    return key in EVENT_KEYS or any(key == s or key.startswith(s + ".") for s in EVENT_SECTIONS)


@dataclass(frozen=True)
class Dimension:
    """One swept key: `choice` over value strings, or `uniform`/`log_uniform` on [low, high)."""

    key: str  # as written, with its +/~ prefix: the override is "<key>=<value>"
    kind: str
    choices: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0

    def draw(self, rng) -> str:
        if self.kind == "choice":
            return f"{self.key}={self.choices[int(rng.integers(len(self.choices)))]}"
        if self.kind == "log_uniform":
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        return f"{self.key}={min(max(value, self.low), self.high)!r}"

    def describe(self) -> str:
        if self.kind == "choice":
            return f"choice({', '.join(self.choices)})"
        return f"{'log-' if self.kind == 'log_uniform' else ''}uniform[{self.low!r}, {self.high!r})"


def _dimension(override: Override) -> Dimension:
    key = override.get_key_element()
    if override.is_discrete_sweep():  # choice(...), a,b,c, range(...)
        return Dimension(key, "choice", tuple(override.sweep_string_iterator()))
    value = override.value()
    if isinstance(value, IntervalSweep):
        low, high = float(value.start), float(value.end)
        log = "log" in value.tags
        if not low < high or (log and low <= 0):
            raise UserError(f"{override.input_line}: an interval needs low < high{' and low > 0 (log)' if log else ''}")
        return Dimension(key, "log_uniform" if log else "uniform", low=low, high=high)
    raise UserError(f"private_search cannot draw from {override.input_line}: use choice(...), a,b,c, range(...), "
                    "interval(a, b) or tag(log, interval(a, b))")


def parse_search_space(arguments: Sequence[str]) -> tuple[list[str], list[Dimension]]:
    """(fixed overrides, swept dimensions) of the sweep's arguments, by Hydra's override parser;
    a swept key that changes the privacy event is refused (one-line UserError)."""
    fixed, dimensions = [], []
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        if not override.is_sweep_override():
            fixed.append(f"{override.get_key_element()}={override.get_value_element_as_str()}")
            continue
        if changes_event(override.key_or_group):
            raise UserError(
                f"private_search cannot sweep {override.key_or_group}: it changes each trial's privacy event, and the "
                "study's epsilon assumes every trial releases the same; fix it for the whole study "
                "(train.lr, privacy.clip_norm, model or algo options that leave the ledger alone may vary)")
        dimensions.append(_dimension(override))
    return fixed, dimensions


def draw_values(dimensions: Sequence[Dimension], rng) -> list[str]:
    """One trial's overrides: every dimension drawn once (from entropy: rng = study.entropy_rng())."""
    return [d.draw(rng) for d in dimensions]


def study_folders(grid: Dict[str, str], studies: int) -> list[tuple[str, list[str]]]:
    """(folder, fixed overrides) of every study of a sweep: the product of the grid's values (Hydra's
    `a,b` grammar), `studies` repetitions each. No grid and one study: [("", [])], the sweep folder."""
    import itertools

    axes = []
    for key, values in grid.items():
        override = OverridesParser.create().parse_overrides([f"{key}={values}"])[0]
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.get_value_element_as_str()]
        axes.append([f"{override.get_key_element()}={value}" for value in choices])
    if not axes and studies == 1:
        return [("", [])]
    plan = []
    for combination in itertools.product(*axes):
        # a folder name Hydra's override grammar reads unquoted (no '=' or ','): algo-grape_seed-0
        label = "_".join(f"{o.lstrip('+~').split('=', 1)[0].rsplit('.', 1)[-1]}-{o.split('=', 1)[1]}" for o in combination)
        for s in range(studies):
            plan.append(("/".join(p for p in (label, f"study_{s}" if studies > 1 else "") if p) or f"study_{s}", list(combination)))
    return plan


def with_config_space(space, fixed: list[str], dimensions: list[Dimension]) -> tuple[list[str], list[Dimension]]:
    """The search space a config declares (`search_space`: {key: spec}, e.g. a tuned preset's per-algo
    table), added to the sweep's: its sweeps are drawn, its plain values fixed. A key declared twice is
    refused: which one holds would be a guess."""
    if not space:
        return fixed, dimensions
    entries = space.items() if hasattr(space, "items") else []
    more_fixed, more = parse_search_space([f"{k}={v}" for k, v in entries])
    named = {o.split("=", 1)[0].lstrip("+~") for o in fixed} | {d.key.lstrip("+~") for d in dimensions}
    for key in [o.split("=", 1)[0].lstrip("+~") for o in more_fixed] + [d.key.lstrip("+~") for d in more]:
        if key in named:
            raise UserError(f"{key} is in the config's search_space and on the command line (or the sweeper's params): "
                            "name it once")
    return [*fixed, *more_fixed], [*dimensions, *more]

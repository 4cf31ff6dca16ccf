"""Which runs are averaged together, and their statistics (mean ± standard error over seeds).

Runs are averaged only when their resolved configs differ in nothing but the seed (`seed`,
`dataset.data_seed`) and ran the same number of steps; otherwise they stay separate groups and a
note names the key that differs.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from dpbench.schema import DEFAULT_SUPPLIERS, PREDATING_VALUES, RUN_INVARIANT_KEYS, USED_ONLY_WITH
from dpbench.tools.report.formatting import fmt_any, fmt_eps
from dpbench.tools.report.load import RunRow

SEED_KEYS = ("seed", "dataset.data_seed")
# Keys that never change what a run computes (where it logs, whether it resumes, the report block,
# the audit's options) or only supply other keys' values (an algorithm's defaults, a preset's
# tables): a key added in a later version does not split runs made before it.
IGNORED_PREFIXES = ("device", "report", "hydra", *RUN_INVARIANT_KEYS, *DEFAULT_SUPPLIERS)


def _comparable(row: RunRow) -> dict:
    """What must agree for two runs to be averaged: the config minus seeds and bookkeeping, plus
    the steps that actually ran and the status (a diverged run is never averaged with a finished one)."""
    config = {**{k: v for k, v in PREDATING_VALUES.items() if k.split(".")[0] + ".name" in row.config}, **row.config}
    keys = {k: v for k, v in config.items() if k not in SEED_KEYS and not k.startswith(IGNORED_PREFIXES)}
    if keys.get("train.compute_budget") is not None:
        keys.pop("train.steps", None)  # the budget set the steps (run.steps below holds them)
        keys.pop("train.epochs", None)
    else:
        keys.pop("train.compute_budget", None)  # unset: as in a run from before the key
    if keys.get("train.steps") is not None:
        keys.pop("train.epochs", None)  # steps win: epochs change nothing (resume.UNUSED_WITH_STEPS)
    for dotted, (switch, value) in USED_ONLY_WITH.items():
        if keys.get(switch) != value:  # unread (the label descriptions of a random head)
            keys.pop(dotted, None)
    if not row.private:  # ε, δ, C, accountant do not change what a non-private run computes
        keys = {k: v for k, v in keys.items() if not k.startswith(("privacy.", "accountant.")) or k == "privacy.sampling"}
    for k in ("algo", "dataset", "model", "target_epsilon", "steps", "status", "batch_size", "sampling"):
        keys[f"run.{k}"] = row[k]
    return keys


@dataclass
class Group:
    rows: list[RunRow]
    key: tuple
    setting: dict = field(default_factory=dict)   # the keys that tell it apart from its neighbours

    @property
    def first(self) -> RunRow:
        return self.rows[0]

    def values(self, name: str) -> list[float]:
        return [r.get(name) for r in self.rows if r.get(name) is not None]

    def mean(self, name: str) -> float | None:
        values = self.values(name)
        return statistics.fmean(values) if values else None

    def se(self, name: str) -> float | None:
        values = self.values(name)
        return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None

    @property
    def main(self) -> tuple:
        r = self.first
        return (r.dataset, r.model, r.algo, r.target_epsilon if r.private else None)


def group_runs(rows: list[RunRow]) -> tuple[list[Group], list[str]]:
    """Groups of runs that differ only in the seed, and notes naming what kept neighbours apart."""
    by_key: dict[tuple, list[RunRow]] = defaultdict(list)
    for row in rows:
        by_key[tuple(sorted(_comparable(row).items(), key=lambda kv: kv[0]))].append(row)
    groups = [Group(members, key) for key, members in by_key.items()]
    notes = []
    by_main: dict[tuple, list[Group]] = defaultdict(list)
    for g in groups:
        by_main[g.main].append(g)
    for main, neighbours in by_main.items():
        if len(neighbours) < 2:
            continue
        differing = _differing_keys([dict(g.key) for g in neighbours])
        for g in neighbours:
            g.setting = {k: dict(g.key).get(k) for k in differing}
        shown = ", ".join(f"{k} ({' vs '.join(sorted({fmt_any(dict(g.key).get(k)) for g in neighbours}))})" for k in differing[:4])
        notes.append(f"not averaged: {sum(len(g.rows) for g in neighbours)} runs of {main[2]} on {main[0]} "
                     f"({main[1]}, ε={fmt_eps(main[3])}) differ in {shown}")
    groups.sort(key=lambda g: (str(g.main[0]), str(g.main[1]), str(g.main[2]), g.main[3] or math.inf, sorted(map(str, g.setting.items()))))
    return groups, notes


def _differing_keys(configs: list[dict]) -> list[str]:
    keys = sorted(set().union(*configs))
    return [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]


def accuracy_percent(g: Group, metric: str) -> tuple[float | None, float | None]:
    """Mean and standard error of the chosen metric (final or best), in %."""
    mean, se = g.mean(metric), g.se(metric)
    return (None if mean is None else 100 * mean), (None if se is None else 100 * se)


def cells(groups: list[Group]) -> dict[tuple, list[Group]]:
    """Groups that an ordering compares: same dataset, model, batch, compute budget (None: none) and
    target ε. Non-private runs (ε = ∞) join every ε of their dataset/model/batch/budget, as a reference."""
    private = defaultdict(list)
    public = defaultdict(list)
    for g in groups:
        base = (g.first.dataset, g.first.model, g.first.batch_size, g.first.compute_budget)
        (private if g.first.private else public)[base].append(g)
    out: dict[tuple, list[Group]] = {}
    for base, members in private.items():
        for eps in sorted({g.first.target_epsilon for g in members}, key=lambda e: e or 0):
            out[base + (eps,)] = [g for g in members if g.first.target_epsilon == eps] + public.get(base, [])
    for base, members in public.items():
        if base not in private:
            out[base + (None,)] = members
    return out


RATIO_FIGURES = ("peak_mib", "run_mib", "per_sample_grad_bytes", "samples_per_s")


@dataclass(frozen=True)
class Ratio:
    """One method's figures over another's at one batch size (None: either did not measure it)."""

    batch_size: int | None
    peak_mib: float | None
    run_mib: float | None
    per_sample_grad_bytes: float | None
    samples_per_s: float | None


def ratios(rows: list[RunRow], numerator: str = "grape", denominator: str = "dpadam") -> list[Ratio]:
    """numerator/denominator of peak memory, per-sample-gradient bytes and throughput at equal batch
    (the memory presets' summary line)."""
    by_key = {(r.algo, r.batch_size): r for r in rows}
    out = []
    for (algo, batch), r in sorted(by_key.items(), key=lambda kv: kv[0][1] or 0):
        other = by_key.get((denominator, batch))
        if algo != numerator or other is None:
            continue

        def ratio(key):
            a, b = r.get(key), other.get(key)
            return a / b if a is not None and b else None

        out.append(Ratio(batch, **{k: ratio(k) for k in RATIO_FIGURES}))
    return out

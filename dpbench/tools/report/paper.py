"""The paper's number beside ours: which paper table a folder of runs reproduces (--paper, or the
preset's `report.paper`/`report.table`) and the cell that matches a group of runs."""

from __future__ import annotations

from dataclasses import dataclass

from dpbench.papers import lookup, parse_table_ref, table as paper_table
from dpbench.tools.report.groups import Group

ACCURACY_METRICS = ("final", "best")
# The paper's metric -> the results.json key `lookup` matches (None: the accuracy itself).
PAPER_KEYS = {"final": None, "best": None, "throughput": "throughput.samples_per_s", "memory": "memory.peak_bytes"}


@dataclass
class PaperRef:
    paper: str
    table: str
    column: str | None = None   # pinned paper column (mini tables: digits compared with MNIST)


def paper_ref(groups: list[Group], explicit: str | None) -> PaperRef | None:
    """--paper, or the paper/table the preset recorded under `report` (when all runs agree)."""
    reports = [g.first.report for g in groups]
    column = next((r.get("column") for r in reports if r.get("column")), None)
    if explicit:
        default = next((r.get("paper") for r in reports if r.get("paper")), None)
        paper, name = parse_table_ref(explicit, default)
        return PaperRef(paper, name, column)
    refs = {(r.get("paper"), r.get("table")) for r in reports if r.get("paper") and r.get("table")}
    if len(refs) != 1:
        return None
    paper, name = parse_table_ref(str(next(iter(refs))[1]), next(iter(refs))[0])
    return PaperRef(paper, name, column)


def identity(g: Group) -> dict:
    """What a paper cell is matched against: the run's algorithm options without the `algo.` prefix,
    plus algo, dataset, model, target epsilon, clipping rule and planned steps."""
    r = g.first
    out = {k: v for k, v in r.algo_config.items() if not isinstance(v, (dict, list))}
    out.update(algo=r.algo, dataset=r.dataset, model=r.model, clipping=r.clipping, steps=r.planned_steps)
    if r.private and r.target_epsilon is not None:
        out["epsilon"] = r.target_epsilon
    return out


def paper_value(g: Group, ref: PaperRef | None):
    if ref is None:
        return None
    spec = paper_table(ref.paper, ref.table)
    if spec.metric not in PAPER_KEYS:
        return None
    compared = {**identity(g), **(g.first.report.get("compare_as") or {})}  # mini tables: digits as MNIST
    return lookup(ref.paper, ref.table, compared, column=ref.column, key=PAPER_KEYS[spec.metric])


def caption(ref: PaperRef) -> str:
    return paper_table(ref.paper, ref.table).caption

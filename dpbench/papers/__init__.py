"""The five papers' reported numbers, as data (one YAML file per paper, shipped with the package).

    from dpbench.papers import table, lookup
    table("dpgrape", "T6").entries          # every cell: row, column, value, ± , metric, caption
    lookup("dpgrape", "T6", {"algo": "grape", "epsilon": 8, "dataset": "mnist", "model": "vit-base"})

Each row and column carries a `match` dict (algo, epsilon, dataset, model, clipping, steps, ...):
a cell describes the runs whose identity contains both. `lookup` returns the most specific cell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

import yaml

from dpbench.errors import UserError

PAPERS = ("dpgrape", "dpzero", "dcdpsgd", "dpdr")
_CELL = re.compile(r"^\s*(-?[0-9.eE+-]+)\s*±\s*([0-9.eE+-]+)\s*$")


@dataclass(frozen=True)
class PaperValue:
    paper: str
    table: str
    row: str
    column: str
    value: float | None      # None: the paper has no number (e.g. OOM; see `missing`)
    pm: float | None         # the ± the paper gives (SE, or std where the caption says so)
    metric: str              # final | best | throughput | memory | cost | hyperparameter
    quantity: str
    unit: str
    caption: str
    match: dict = field(default_factory=dict)
    missing: str | None = None


@dataclass(frozen=True)
class PaperTable:
    paper: str
    name: str
    caption: str
    metric: str
    quantity: str
    unit: str
    entries: tuple[PaperValue, ...]
    settings: dict

    @property
    def columns(self) -> list[str]:
        return list(dict.fromkeys(e.column for e in self.entries))


def parse_cell(cell) -> tuple[float | None, float | None]:
    """'93.1 ± 0.3' -> (93.1, 0.3); 60.2 -> (60.2, None); null -> (None, None)."""
    if cell is None:
        return None, None
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell), None
    found = _CELL.match(str(cell))
    if not found:
        raise ValueError(f"not a paper number: {cell!r} (write 'mean ± pm', a number, or null)")
    return float(found.group(1)), float(found.group(2))


@lru_cache(maxsize=None)
def load_paper(paper: str) -> dict:
    if paper not in PAPERS:
        raise UserError(f"unknown paper {paper!r}; use one of {', '.join(PAPERS)}")
    text = resources.files("dpbench.papers").joinpath(f"{paper}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def tables(paper: str) -> list[str]:
    return list(load_paper(paper)["tables"])


def table(paper: str, name: str) -> PaperTable:
    data = load_paper(paper)
    spec = _find(data["tables"], name, f"{paper} has no table {name!r}; it has {', '.join(data['tables'])}")
    columns = spec["columns"]
    entries = []
    for label, row_match, *cells in spec["rows"]:
        if len(cells) != len(columns):
            raise ValueError(f"{paper} {name} row {label!r}: {len(cells)} values for {len(columns)} columns")
        for column, cell in zip(columns, cells):
            value, pm = parse_cell(cell)
            entries.append(PaperValue(
                paper, name, str(label), str(column), value, pm, spec["metric"], spec["quantity"], spec["unit"],
                spec["caption"], {**(columns[column] or {}), **(row_match or {})},
                spec.get("missing") if value is None else None,
            ))
    settings = (data.get("settings") or {}).get(name, {})
    return PaperTable(paper, name, spec["caption"], spec["metric"], spec["quantity"], spec["unit"], tuple(entries), settings)


def _find(mapping: dict, name: str, error: str):
    for key in mapping:
        if key.lower() == str(name).lower():
            return mapping[key]
    raise UserError(error)


def parse_table_ref(ref: str, default_paper: str | None = None) -> tuple[str, str]:
    """'dpgrape:T6', 'dpgrape_t6', 'dpgrape_t6_mini' or (with a default paper) 'T6' -> ('dpgrape', 'T6')."""
    found = re.match(r"^(?:(?P<paper>[a-z]+)[:_])?(?P<table>t[0-9]+[a-z-]*)", ref.strip(), re.IGNORECASE)
    paper = (found and found.group("paper")) or default_paper
    if not found or paper is None:
        raise UserError(f"--paper {ref!r}: write PAPER:TABLE, e.g. dpgrape:T6 (papers: {', '.join(PAPERS)})")
    name = found.group("table").upper()
    names = {n.upper(): n for n in tables(paper.lower())}
    if name not in names:  # e.g. 't7-memory' typed as 'T7-MEMORY'
        raise UserError(f"{paper} has no table {name}; it has {', '.join(names.values())}")
    return paper.lower(), names[name]


def matches(cell: dict, identity: dict) -> bool:
    """A cell matches a run when every key the cell names agrees (keys the run lacks never match)."""
    for key, want in cell.items():
        if key == "key":  # which measured quantity a column holds, not part of the run's identity
            continue
        have = identity.get(key, _ABSENT)
        if have is _ABSENT:
            return False
        if isinstance(want, (int, float)) and isinstance(have, (int, float)) and not isinstance(want, bool):
            if abs(float(want) - float(have)) > 1e-9 * max(1.0, abs(float(want))):
                return False
        elif want != have:
            return False
    return True


_ABSENT = object()


def lookup(paper: str, name: str, identity: dict, column: str | None = None, key: str | None = None) -> PaperValue | None:
    """The paper's number for runs with this identity (most specific match), or None.

    `column` pins the paper column (e.g. a mini table run on digits compares with the MNIST column):
    then only the row's match and the column label are used. `key` picks the measured quantity in
    tables whose columns hold several (e.g. "throughput.samples_per_s"); None = the accuracy / F1 cells.
    """
    best, best_score = None, -1
    for entry in table(paper, name).entries:
        if entry.match.get("key") != key:
            continue
        if column is not None:
            if entry.column != column:
                continue
            row_match = {k: v for k, v in entry.match.items() if k not in _column_keys(paper, name, column)}
            ok, score = matches(row_match, identity), len(row_match)
        else:
            ok, score = matches(entry.match, identity), len(entry.match)
        if ok and score > best_score:
            best, best_score = entry, score
    return best


def _column_keys(paper: str, name: str, column: str) -> set[str]:
    spec = _find(load_paper(paper)["tables"], name, "")
    columns = spec["columns"]
    if column not in columns:
        raise UserError(f"{paper} {name} has no column {column!r}; it has {', '.join(columns)}")
    return set(columns[column] or {})

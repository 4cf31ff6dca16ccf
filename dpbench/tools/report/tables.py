"""The paper-style table (one row per group of runs) and its renderings: rich, markdown, csv, latex."""

from __future__ import annotations

import csv
import io

from rich.table import Table

from dpbench.errors import UserError
from dpbench.tools.report.formatting import fmt, fmt_any, fmt_eps
from dpbench.tools.report.groups import Group, accuracy_percent
from dpbench.tools.report.paper import ACCURACY_METRICS, PaperRef, paper_value

APPROXIMATE_ACCOUNTANTS = {"gdp": "GDP (CLT approximation)"}
FORMATS = ("rich", "markdown", "csv", "latex")
# Columns right-aligned in the terminal.
NUMERIC_COLUMNS = ("seeds", "steps", "peak MiB", "samples/s")


def choose_metric(groups: list[Group], explicit: str | None) -> str:
    if explicit:
        return explicit
    stated = {g.first.report.get("metric") for g in groups} - {None}
    return stated.pop() if len(stated) == 1 else "final"


def flags(g: Group) -> str:
    r, out = g.first, []
    if r.unproven_sampling:
        out.append(f"{r.sampling}-sampled: ε not a proven bound")
    if r.unproven_bound:
        out.append("paper's accounting: ε not a proven bound")
    if r.accountant in APPROXIMATE_ACCOUNTANTS:
        out.append(f"approximate accountant {APPROXIMATE_ACCOUNTANTS[r.accountant]}")
    if r.paper_accounting:
        out.append("paper's σ (true ε shown)")
    if r.status not in (None, "completed"):
        out.append(str(r.status))
    return "; ".join(out)


def build_table(groups: list[Group], metric: str, ref: PaperRef | None) -> tuple[list[str], list[list[str]]]:
    metric_name = next((g.first.metric_name for g in groups if g.first.metric_name), "accuracy")
    header = ["dataset", "model", "algo", "setting", "target ε", "ε spent", "seeds", "steps",
              f"{metric} {metric_name} %", "peak MiB", "samples/s"]
    if ref is not None:
        header += [f"paper {ref.paper} {ref.table}", "Δ"]
    header.append("flags")
    body = []
    for g in groups:
        r = g.first
        mean, se = accuracy_percent(g, metric)
        ours = fmt(mean, ".1f") + ("" if se is None else f" ± {se:.1f}")
        row = [str(r.dataset), str(r.model), str(r.algo),
               ", ".join(f"{k}={fmt_any(v)}" for k, v in g.setting.items()),
               fmt_eps(r.target_epsilon if r.private else None),
               fmt_eps(g.mean("epsilon") if r.private else None, ".2f"),
               str(len(g.rows)), fmt_any(r.steps), ours,
               fmt(g.mean("peak_mib"), ".0f"), fmt(g.mean("samples_per_s"), ".1f")]
        if ref is not None:
            row += _paper_cells(g, ref, mean)
        row.append(flags(g))
        body.append(row)
    return header, body


def _paper_cells(g: Group, ref: PaperRef, ours: float | None) -> list[str]:
    found = paper_value(g, ref)
    if found is None:
        return ["—", "—"]
    if found.value is None:
        return [found.missing or "n/a", "—"]
    text = fmt(found.value, "g") + ("" if found.pm is None else f" ± {found.pm:g}")
    if found.metric in ACCURACY_METRICS:
        return [text, fmt(None if ours is None else ours - found.value, "+.1f")]
    if found.metric == "throughput":
        speed = g.mean("samples_per_s")
        return [text + " samples/s", fmt(None if speed is None else speed / found.value, ".2f") + "×"]
    return [text, "—"]


def latex_escape(text: str) -> str:
    return (text.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")
            .replace("±", r"$\pm$").replace("ε", r"$\varepsilon$").replace("∞", r"$\infty$").replace("Δ", r"$\Delta$"))


def render(header: list[str], body: list[list[str]], fmt: str, title: str, numeric: tuple[str, ...] = NUMERIC_COLUMNS,
           narrow: bool = False):
    """The table as a rich Table (fmt='rich') or as text (markdown, csv, latex). `narrow`: each column
    of the terminal table only as wide as its cells and the longest word of its header (the
    headers wrap), so that many columns fit."""
    if fmt == "rich":
        table = Table(title=title, pad_edge=not narrow)
        for i, column in enumerate(header):
            width = max([len(row[i]) for row in body] + [len(word) for word in column.split()]) if narrow else None
            table.add_column(column, justify="right" if column in numeric else "left", max_width=width, min_width=width)
        for row in body:
            table.add_row(*row)
        return table
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
        return "\n".join(lines)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(header)
        writer.writerows(body)
        return buffer.getvalue().rstrip("\n")
    if fmt == "latex":
        lines = [r"\begin{table}", rf"\caption{{{latex_escape(title)}}}", r"\begin{tabular}{" + "l" * len(header) + "}", r"\toprule",
                 " & ".join(map(latex_escape, header)) + r" \\", r"\midrule"]
        lines += [" & ".join(map(latex_escape, row)) + r" \\" for row in body]
        return "\n".join(lines + [r"\bottomrule", r"\end{tabular}", r"\end{table}"])
    raise UserError(f"--format {fmt!r} is not known; use rich, markdown, csv or latex")

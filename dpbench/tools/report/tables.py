"""The paper-style table (one row per group of runs), the privacy audits' table, and their
renderings: rich, markdown, csv, latex."""

from __future__ import annotations

import csv
import io

from rich.table import Table

from dpbench.errors import UserError
from dpbench.tools.report.formatting import fmt, fmt_any, fmt_bound, fmt_eps
from dpbench.tools.report.groups import Group, accuracy_percent
from dpbench.tools.report.load import AuditRow
from dpbench.tools.report.paper import ACCURACY_METRICS, PaperRef, paper_value

APPROXIMATE_ACCOUNTANTS = {"gdp": "GDP (CLT approximation)"}
FORMATS = ("rich", "markdown", "csv", "latex")
# Columns right-aligned in the terminal.
NUMERIC_COLUMNS = ("seeds", "steps", "own peak MiB", "process peak MiB", "predicted GPU peak MiB", "samples/s", "audit ε≥",
                   "ceiling", "validation % (noisy)")
AUDIT_HEADER = ["folder", "algo", "model", "dataset", "claimed ε", "ε lower bound", "ceiling", "canaries",
                "correct / guesses", "verdict"]
AUDIT_NUMERIC = ("claimed ε", "ε lower bound", "ceiling", "canaries", "correct / guesses")
AUDIT_TITLE = "Privacy audits (dpbench-audit: the accountant's ε beside the empirical lower bound)"


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
    if (r.report or {}).get("selected_on") == "test":
        out.append("selected on test")  # hyperparameters picked on test accuracy: optimistic
    if r.status not in (None, "completed"):
        out.append(str(r.status))
    failed = sorted({name for row in g.rows if row.audit_passed is False for name in row.audit_failed_checks})
    if any(row.audit_passed is False for row in g.rows):
        out.append("audit FAILED" + (f": {', '.join(failed)}" if failed else ""))
    return "; ".join(out)


def audit_cell(g: Group, name: str) -> str:
    """An audit figure of the group's runs: one value, or the range over its audited seeds."""
    values = g.values(name)
    if not values:
        return "—"
    low, high = min(values), max(values)
    return fmt_bound(low) if low == high else f"{fmt_bound(low)} – {fmt_bound(high)}"  # spaced: a narrow terminal wraps it


def build_table(groups: list[Group], metric: str, ref: PaperRef | None,
                predicted_mib: list[float | None] | None = None) -> tuple[list[str], list[list[str]]]:
    """`predicted_mib`: each group's predicted GPU peak (report/predicted.py), a column when given."""
    metric_name = next((g.first.metric_name for g in groups if g.first.metric_name), "accuracy")
    # the memory glossary's names (docs/results.md): the run's own peak, the process's peak, the prediction
    header = ["dataset", "model", "algo", "setting", "target ε", "ε spent", "seeds", "steps",
              f"{metric} {metric_name} %", "own peak MiB", "process peak MiB", "samples/s"]
    if predicted_mib is not None:
        header.insert(header.index("samples/s"), "predicted GPU peak MiB")
    # the one-run audit's lower bound on ε and its ceiling, beside ε spent: only when some run has them
    audited = any(r.audit_epsilon_lower_bound is not None or r.audit_ceiling is not None for g in groups for r in g.rows)
    if audited:
        header[6:6] = ["audit ε≥", "ceiling"]
    # the noisy validation score (what a private study selects on), beside the test metric: only when some run has one
    validated = any(r.validation is not None for g in groups for r in g.rows)
    if validated:
        header.insert(header.index(f"{metric} {metric_name} %") + 1, "validation % (noisy)")
    if ref is not None:
        header += [f"paper {ref.paper} {ref.table}", "Δ"]
    header.append("flags")
    body = []
    for index, g in enumerate(groups):
        r = g.first
        mean, se = accuracy_percent(g, metric)
        ours = fmt(mean, ".1f") + ("" if se is None else f" ± {se:.1f}")
        row = [str(r.dataset), str(r.model), str(r.algo),
               ", ".join(f"{k}={fmt_any(v)}" for k, v in g.setting.items()),
               fmt_eps(r.target_epsilon if r.private else None),
               fmt_eps(g.mean("epsilon") if r.private else None, ".2f"),
               *([audit_cell(g, "audit_epsilon_lower_bound"), audit_cell(g, "audit_ceiling")] if audited else []),
               str(len(g.rows)), fmt_any(r.steps), ours,
               *([fmt(accuracy_percent(g, "validation")[0], ".1f")] if validated else []),
               fmt(g.mean("own_mib"), ".0f"), fmt(g.mean("peak_mib"), ".0f"),
               *([fmt(predicted_mib[index], ".0f")] if predicted_mib is not None else []),
               fmt(g.mean("samples_per_s"), ".1f")]
        if ref is not None:
            row += _paper_cells(g, ref, mean)
        row.append(flags(g))
        body.append(row)
    return header, body


def build_audit_table(audits: list[AuditRow]) -> tuple[list[str], list[list[str]]]:
    """One row per audit.json: the accountant's ε, the one-run lower bound and ceiling, the guesses,
    the verdict (with the failed checks' names); a checks-only audit has its verdict only."""
    body = []
    for a in audits:
        guesses = f"{a.correct}/{a.guesses}" if a.correct is not None and a.guesses is not None else "—"
        body.append([a.path, fmt_any(a.algo), fmt_any(a.model), fmt_any(a.dataset), fmt(a.claimed_epsilon, ".2f"),
                     fmt_bound(a.epsilon_lower_bound), fmt_bound(a.ceiling), fmt_any(a.canaries), guesses, a.verdict])
    return list(AUDIT_HEADER), body


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
            .replace("±", r"$\pm$").replace("ε", r"$\varepsilon$").replace("∞", r"$\infty$").replace("Δ", r"$\Delta$")
            .replace("≥", r"$\geq$"))


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

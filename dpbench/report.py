"""`dpbench-report DIR`: the runs under DIR as a paper-style table (mean ± SE over seeds, the paper's
number beside ours), the ordering check of a mini table, and plots.

    dpbench-report outputs/multirun/dpgrape_t6_mini                      # paper/table from the preset
    dpbench-report outputs/multirun/x --paper dpgrape:T6 --metric best --format markdown
    dpbench-report outputs/multirun/dpgrape_t6_mini --check               # exit 1 if report.expect fails

Runs are averaged only when their resolved configs differ in nothing but the seed (`seed`,
`dataset.data_seed`) and ran the same number of steps; otherwise they stay separate rows and a
note names the key that differs.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import math
import operator
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from dpbench.errors import UserError
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE, RunResults
from dpbench.papers import lookup, parse_table_ref, table as paper_table

MIB = 2**20
SEED_KEYS = ("seed", "dataset.data_seed")
# Keys that never change what a run computes (where it logs, whether it resumes, the report block).
IGNORED_PREFIXES = ("logger", "device", "resume", "name", "report", "hydra")
APPROXIMATE_ACCOUNTANTS = {"gdp": "GDP (CLT approximation)"}
ACCURACY_METRICS = ("final", "best")
INFINITY = "∞"


# ---------------------------------------------------------------- reading results.json


def flatten(tree, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists become tuples so values are hashable."""
    if not isinstance(tree, dict):
        return {prefix: tuple(tree) if isinstance(tree, list) else tree}
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = _hashable(value)
    return out


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def model_label(results: RunResults, config: dict) -> str | None:
    """'vit-base', 'opt-1.3b', 'tanh_cnn': the model name plus its size when the config has one."""
    name = results.model or (config.get("model") or {}).get("name")
    size = (config.get("model") or {}).get("size")
    return f"{name}-{size}" if name and size else name


def unproven_sampling(privacy, config: dict) -> bool:
    """A private shuffled run from before schema 4: it reported the Poisson accountant's epsilon."""
    sampling = privacy.sampling or (config.get("privacy") or {}).get("sampling")
    return bool(privacy.is_private and privacy.bound is None and sampling not in (None, "poisson"))


def run_row(path: Path, folder: Path, results: RunResults) -> dict:
    """One flat record per results.json; every key may be missing in old files (then None)."""
    config = results.config or {}
    figures, privacy = results.summary(), results.privacy
    private = figures["privacy/private"]
    peak, start = figures["memory/peak_bytes"], figures["memory/start_bytes"]
    return {
        "path": str(path.parent.relative_to(folder)) or ".",
        "algo": results.algo or (config.get("algo") or {}).get("name"),
        "dataset": results.dataset or (config.get("dataset") or {}).get("name"),
        "model": model_label(results, config),
        "seed": results.seed if results.seed is not None else config.get("seed"),
        "status": figures["status"],
        "private": private,
        "target_epsilon": privacy.target_epsilon if private else None,
        "epsilon": figures["privacy/epsilon"] if private else None,
        "steps": privacy.steps,
        "planned_steps": privacy.planned_steps if privacy.planned_steps is not None else privacy.steps,
        "accountant": privacy.accountant,
        "sampling": privacy.sampling or (config.get("privacy") or {}).get("sampling"),
        "unproven_sampling": unproven_sampling(privacy, config),
        "clipping": (config.get("privacy") or {}).get("clipping"),
        "metric_name": results.metrics.metric or "accuracy",
        "final": figures["test/accuracy"],
        "best": figures["test/best_accuracy"],
        "batch_size": (config.get("train") or {}).get("batch_size"),
        "peak_mib": peak / MIB if peak is not None else None,
        "run_mib": (peak - start) / MIB if peak is not None and start is not None else None,
        "memory_kind": figures["memory/kind"],
        "per_sample_grad_bytes": figures["memory/per_sample_grad_bytes"],
        "optimizer_state_bytes": figures["memory/optimizer_state_bytes"],
        "samples_per_s": figures["throughput/samples_per_s"],
        "device": (results.versions or {}).get("device"),
        "paper_accounting": bool((config.get("algo") or {}).get("paper_accounting")),
        "report": config.get("report") or {},
        "algo_config": config.get("algo") or {},
        "config": flatten(config) if config else {},
    }


def load_rows(folder: Path) -> list[dict]:
    """One row per results.json under `folder` (unreadable files are reported and skipped)."""
    rows = []
    for path in sorted(folder.rglob(RESULTS_FILE)):
        try:
            results = RunResults.from_json(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as error:
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
            continue
        rows.append(run_row(path, folder, results))
    return sorted(rows, key=lambda r: (str(r["algo"]), r["batch_size"] or 0, r["epsilon"] or 0.0))


# ---------------------------------------------------------------- grouping


def _comparable(row: dict) -> dict:
    """What must agree for two runs to be averaged: the config minus seeds and bookkeeping, plus
    the steps that actually ran and the status (a diverged run is never averaged with a finished one)."""
    keys = {k: v for k, v in row["config"].items() if k not in SEED_KEYS and not k.startswith(IGNORED_PREFIXES)}
    if not row["private"]:  # ε, δ, C, accountant do not change what a non-private run computes
        keys = {k: v for k, v in keys.items() if not k.startswith(("privacy.", "accountant.")) or k == "privacy.sampling"}
    for k in ("algo", "dataset", "model", "target_epsilon", "steps", "status", "batch_size", "sampling"):
        keys[f"run.{k}"] = row[k]
    return keys


@dataclass
class Group:
    rows: list[dict]
    key: tuple
    setting: dict = field(default_factory=dict)   # the keys that tell it apart from its neighbours

    @property
    def first(self) -> dict:
        return self.rows[0]

    def values(self, name: str) -> list[float]:
        return [r[name] for r in self.rows if r.get(name) is not None]

    def mean(self, name: str) -> float | None:
        values = self.values(name)
        return statistics.fmean(values) if values else None

    def se(self, name: str) -> float | None:
        values = self.values(name)
        return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None

    @property
    def main(self) -> tuple:
        r = self.first
        return (r["dataset"], r["model"], r["algo"], r["target_epsilon"] if r["private"] else None)


def group_runs(rows: list[dict]) -> tuple[list[Group], list[str]]:
    """Groups of runs that differ only in the seed, and notes naming what kept neighbours apart."""
    by_key: dict[tuple, list[dict]] = defaultdict(list)
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
        shown = ", ".join(f"{k} ({' vs '.join(sorted({_fmt_any(dict(g.key).get(k)) for g in neighbours}))})" for k in differing[:4])
        notes.append(f"not averaged: {sum(len(g.rows) for g in neighbours)} runs of {main[2]} on {main[0]} "
                     f"({main[1]}, ε={_fmt_eps(main[3])}) differ in {shown}")
    groups.sort(key=lambda g: (str(g.main[0]), str(g.main[1]), str(g.main[2]), g.main[3] or math.inf, sorted(map(str, g.setting.items()))))
    return groups, notes


def _differing_keys(configs: list[dict]) -> list[str]:
    keys = sorted(set().union(*configs))
    return [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]


# ---------------------------------------------------------------- the paper's numbers


@dataclass
class PaperRef:
    paper: str
    table: str
    column: str | None = None   # pinned paper column (mini tables: digits compared with MNIST)


def paper_ref(groups: list[Group], explicit: str | None) -> PaperRef | None:
    """--paper, or the paper/table the preset recorded under `report` (when all runs agree)."""
    reports = [g.first["report"] for g in groups]
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
    out = {k: v for k, v in r["algo_config"].items() if not isinstance(v, (dict, list))}
    out.update(algo=r["algo"], dataset=r["dataset"], model=r["model"], clipping=r["clipping"], steps=r["planned_steps"])
    if r["private"] and r["target_epsilon"] is not None:
        out["epsilon"] = r["target_epsilon"]
    return out


PAPER_KEYS = {"final": None, "best": None, "throughput": "throughput.samples_per_s", "memory": "memory.peak_bytes"}


def paper_value(g: Group, ref: PaperRef | None):
    if ref is None:
        return None
    spec = paper_table(ref.paper, ref.table)
    if spec.metric not in PAPER_KEYS:
        return None
    compared = {**identity(g), **(g.first["report"].get("compare_as") or {})}  # mini tables: digits as MNIST
    return lookup(ref.paper, ref.table, compared, column=ref.column, key=PAPER_KEYS[spec.metric])


# ---------------------------------------------------------------- the table


def choose_metric(groups: list[Group], explicit: str | None) -> str:
    if explicit:
        return explicit
    stated = {g.first["report"].get("metric") for g in groups} - {None}
    return stated.pop() if len(stated) == 1 else "final"


def accuracy_percent(g: Group, metric: str) -> tuple[float | None, float | None]:
    mean, se = g.mean(metric), g.se(metric)
    return (None if mean is None else 100 * mean), (None if se is None else 100 * se)


def flags(g: Group) -> str:
    r, out = g.first, []
    if r["unproven_sampling"]:
        out.append(f"{r['sampling']}-sampled: ε not a proven bound")
    if r["accountant"] in APPROXIMATE_ACCOUNTANTS:
        out.append(f"approximate accountant {APPROXIMATE_ACCOUNTANTS[r['accountant']]}")
    if r["paper_accounting"]:
        out.append("paper's σ (true ε shown)")
    if r["status"] not in (None, "completed"):
        out.append(str(r["status"]))
    return "; ".join(out)


def build_table(groups: list[Group], metric: str, ref: PaperRef | None) -> tuple[list[str], list[list[str]]]:
    metric_name = next((g.first["metric_name"] for g in groups if g.first["metric_name"]), "accuracy")
    header = ["dataset", "model", "algo", "setting", "target ε", "ε spent", "seeds", "steps",
              f"{metric} {metric_name} %", "peak MiB", "samples/s"]
    if ref is not None:
        header += [f"paper {ref.paper} {ref.table}", "Δ"]
    header.append("flags")
    body = []
    for g in groups:
        r = g.first
        mean, se = accuracy_percent(g, metric)
        ours = _fmt(mean, ".1f") + ("" if se is None else f" ± {se:.1f}")
        row = [str(r["dataset"]), str(r["model"]), str(r["algo"]),
               ", ".join(f"{k}={_fmt_any(v)}" for k, v in g.setting.items()),
               _fmt_eps(r["target_epsilon"] if r["private"] else None),
               _fmt_eps(g.mean("epsilon") if r["private"] else None, ".2f"),
               str(len(g.rows)), _fmt_any(r["steps"]), ours,
               _fmt(g.mean("peak_mib"), ".0f"), _fmt(g.mean("samples_per_s"), ".1f")]
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
    text = _fmt(found.value, "g") + ("" if found.pm is None else f" ± {found.pm:g}")
    if found.metric in ACCURACY_METRICS:
        return [text, _fmt(None if ours is None else ours - found.value, "+.1f")]
    if found.metric == "throughput":
        speed = g.mean("samples_per_s")
        return [text + " samples/s", _fmt(None if speed is None else speed / found.value, ".2f") + "×"]
    return [text, "—"]


def render(header: list[str], body: list[list[str]], fmt: str, title: str):
    if fmt == "rich":
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="right" if column in ("seeds", "steps", "peak MiB", "samples/s") else "left")
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
        escape = lambda s: s.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&").replace("±", r"$\pm$").replace("ε", r"$\varepsilon$").replace("∞", r"$\infty$").replace("Δ", r"$\Delta$")
        lines = [r"\begin{table}", rf"\caption{{{escape(title)}}}", r"\begin{tabular}{" + "l" * len(header) + "}", r"\toprule",
                 " & ".join(map(escape, header)) + r" \\", r"\midrule"]
        lines += [" & ".join(map(escape, row)) + r" \\" for row in body]
        return "\n".join(lines + [r"\bottomrule", r"\end{tabular}", r"\end{table}"])
    raise UserError(f"--format {fmt!r} is not known; use rich, markdown, csv or latex")


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _fmt_any(value) -> str:
    if value is None:
        return "—"
    return format(value, "g") if isinstance(value, float) else str(value)


def _fmt_eps(value, spec: str = "g") -> str:
    """Non-private runs show ∞ everywhere (target and spent)."""
    return INFINITY if value is None or value == math.inf else format(value, spec)


# ---------------------------------------------------------------- the ordering check


QUANTITIES = {
    "accuracy": None,   # the chosen metric, in %
    "final": "final", "best": "best",
    "peak_mib": "peak_mib", "run_mib": "run_mib", "samples_per_s": "samples_per_s", "epsilon": "epsilon",
    "per_sample_grad_mib": "per_sample_grad_bytes", "optimizer_state_mib": "optimizer_state_bytes",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


def cells(groups: list[Group]) -> dict[tuple, list[Group]]:
    """Groups that an ordering compares: same dataset, model, batch and target ε. Non-private runs
    (ε = ∞) join every ε of their dataset/model/batch, as a reference."""
    private = defaultdict(list)
    public = defaultdict(list)
    for g in groups:
        base = (g.first["dataset"], g.first["model"], g.first["batch_size"])
        (private if g.first["private"] else public)[base].append(g)
    out: dict[tuple, list[Group]] = {}
    for base, members in private.items():
        for eps in sorted({g.first["target_epsilon"] for g in members}, key=lambda e: e or 0):
            out[base + (eps,)] = [g for g in members if g.first["target_epsilon"] == eps] + public.get(base, [])
    for base, members in public.items():
        if base not in private:
            out[base + (None,)] = members
    return out


def evaluate(expression: str, cell: list[Group], metric: str) -> tuple[bool, str]:
    """Evaluate e.g. 'grape >= dpadam - 5' or 'grape.per_sample_grad_mib < 0.5 * dpadam.per_sample_grad_mib'.
    A bare algorithm name is its mean accuracy (the report's metric, %)."""
    by_algo: dict[str, list[Group]] = defaultdict(list)
    for g in cell:
        by_algo[g.first["algo"]].append(g)
    shown: list[str] = []

    def value(algo: str, quantity: str) -> float:
        if algo not in by_algo:
            raise KeyError(algo)
        if len(by_algo[algo]) > 1:
            raise UserError(f"report.expect {expression!r}: {algo} has {len(by_algo[algo])} different settings here; make the grid unambiguous")
        g = by_algo[algo][0]
        if quantity not in QUANTITIES:
            raise UserError(f"report.expect {expression!r}: unknown quantity {quantity!r}; use {', '.join(QUANTITIES)}")
        name = QUANTITIES[quantity] or metric
        mean = g.mean(name)
        if mean is None:
            raise KeyError(f"{algo}.{quantity}")
        scaled = 100 * mean if name in ("final", "best") else (mean / MIB if name.endswith("_bytes") else mean)
        shown.append(f"{algo}.{quantity}={scaled:.4g}" if quantity != "accuracy" else f"{algo}={scaled:.4g}")
        return scaled

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            return value(node.id, "accuracy")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return value(node.value.id, node.attr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Compare) and all(type(op) in _OPS for op in node.ops):
            left, ok = walk(node.left), True
            for op, right_node in zip(node.ops, node.comparators):
                right = walk(right_node)
                ok, left = ok and _OPS[type(op)](left, right), right
            return ok
        raise UserError(f"report.expect {expression!r}: only algorithm names, .quantity, numbers, + - * / and comparisons are allowed")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise UserError(f"report.expect {expression!r} is not an expression: {error.msg}") from None
    outcome = walk(tree)
    if not isinstance(outcome, bool):
        raise UserError(f"report.expect {expression!r} must be a comparison, e.g. 'grape >= dpadam - 5'")
    return outcome, ", ".join(shown)


def check(groups: list[Group], metric: str) -> tuple[bool, list[str]]:
    """Every stated ordering in every cell where all its algorithms ran. Fails when none could be evaluated."""
    expectations = list(dict.fromkeys(e for g in groups for e in (g.first["report"].get("expect") or [])))
    if not expectations:
        return False, ["no report.expect in these runs' configs: nothing to check (run a *_mini preset)"]
    lines, evaluated, passed = [], 0, True
    for where, cell in cells(groups).items():
        label = f"{where[0]}/{where[1]} batch {where[2]} ε={_fmt_eps(where[3])}"
        for expression in expectations:
            try:
                ok, shown = evaluate(expression, cell, metric)
            except KeyError as missing:
                lines.append(f"  skipped  {expression}  [{label}]: no runs of {missing.args[0]} here")
                continue
            evaluated += 1
            passed &= ok
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {expression}  [{label}]: {shown}")
    if evaluated == 0:
        return False, lines + ["no stated ordering could be evaluated (missing algorithms?)"]
    return passed, lines


# ---------------------------------------------------------------- plots


def _title(groups: list[Group], what: str) -> str:
    firsts = [g.first for g in groups]
    parts = [", ".join(sorted({str(r[k]) for r in firsts if r[k]})) for k in ("model", "dataset", "device")]
    return f"{what}\n" + " · ".join(p for p in parts if p)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_epsilon(groups: list[Group], metric: str, path: Path) -> Path | None:
    """Mean ± SE per algorithm over ε; non-private runs as horizontal reference lines."""
    private = defaultdict(list)
    for g in groups:
        if g.first["private"] and g.first["target_epsilon"] is not None and g.mean(metric) is not None:
            private[g.first["algo"]].append(g)
    if not any(len({g.first["target_epsilon"] for g in gs}) > 1 for gs in private.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, gs in sorted(private.items()):
        gs = sorted(gs, key=lambda g: g.first["target_epsilon"])
        ys = [accuracy_percent(g, metric) for g in gs]
        ax.errorbar([g.first["target_epsilon"] for g in gs], [y for y, _ in ys], yerr=[e or 0 for _, e in ys],
                    marker="o", capsize=3, label=algo)
    for g in groups:
        if not g.first["private"] and g.mean(metric) is not None:
            ax.axhline(accuracy_percent(g, metric)[0], linestyle="--", color="grey", label=f"{g.first['algo']} (non-private)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε")
    ax.set_ylabel(f"{metric} test accuracy (%, mean ± SE)")
    return _save(fig, ax, _title(groups, "Accuracy vs privacy"), path)


def plot_memory(groups: list[Group], path: Path) -> Path | None:
    """Peak memory vs batch on a log2 axis (the run's own memory where measured); needs >1 batch."""
    return _plot_vs_batch(groups, lambda g: g.mean("run_mib") if g.mean("run_mib") is not None else g.mean("peak_mib"),
                          "memory (MiB; run's own where measured)", "Peak memory vs batch size", path)


def plot_throughput(groups: list[Group], path: Path) -> Path | None:
    return _plot_vs_batch(groups, lambda g: g.mean("samples_per_s"), "samples/s", "Throughput vs batch size", path)


def _plot_vs_batch(groups: list[Group], measure, ylabel: str, what: str, path: Path) -> Path | None:
    if len({g.first["batch_size"] for g in groups if g.first["batch_size"]}) < 2:
        return None
    series = defaultdict(list)
    for g in groups:
        y = measure(g)
        if g.first["batch_size"] and y is not None:
            series[g.first["algo"]].append((g.first["batch_size"], y))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    return _save(fig, ax, _title(groups, what), path)


def _save(fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------- kept for the memory presets


def ratios(rows: list[dict], numerator: str = "grape", denominator: str = "dpadam") -> list[dict]:
    """numerator/denominator of peak memory, per-sample-gradient bytes and throughput at equal batch."""
    by_key = {(r["algo"], r["batch_size"]): r for r in rows}
    out = []
    for (algo, batch), r in sorted(by_key.items(), key=lambda kv: kv[0][1] or 0):
        other = by_key.get((denominator, batch))
        if algo != numerator or other is None:
            continue

        def ratio(key):
            a, b = r.get(key), other.get(key)
            return a / b if a is not None and b else None

        out.append({"batch_size": batch, **{k: ratio(k) for k in ("peak_mib", "run_mib", "per_sample_grad_bytes", "samples_per_s")}})
    return out


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpbench-report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="folder searched recursively for results.json")
    parser.add_argument("--paper", default=None, help="paper table to put beside ours, e.g. dpgrape:T6 (default: the preset's report.paper/table)")
    parser.add_argument("--metric", choices=("final", "best"), default=None, help="final or best test accuracy (default: the preset's report.metric, else final)")
    parser.add_argument("--format", choices=("rich", "markdown", "csv", "latex"), default="rich")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every ordering in report.expect holds")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: the folder)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    try:
        return _report(args)
    except UserError as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        return 2


def _report(args) -> int:
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder; pass the multirun folder, e.g. outputs/multirun/<name>")
    rows = load_rows(args.folder)
    if not rows:
        raise UserError(f"no {RESULTS_FILE} under {args.folder}; run `dpbench -m ...` first")
    groups, notes = group_runs(rows)
    metric = choose_metric(groups, args.metric)
    ref = paper_ref(groups, args.paper)
    title = f"dpbench results ({metric} test accuracy)"
    if ref is not None:
        title += f" beside {ref.paper} {ref.table}" + (f" column {ref.column}" if ref.column else "")
        title += f": {paper_table(ref.paper, ref.table).caption}"
    header, body = build_table(groups, metric, ref)
    rendered = render(header, body, args.format, title)
    if args.format == "rich":
        console.print(rendered)
    else:
        print(rendered)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    for r in ratios(rows):
        console.print(
            f"grape/dpadam at batch {r['batch_size']}: peak memory {_fmt(r['peak_mib'], '.3f')} "
            f"(run's own {_fmt(r['run_mib'], '.3f')}), "
            f"per-sample grads {_fmt(r['per_sample_grad_bytes'], '.3f')}, throughput {_fmt(r['samples_per_s'], '.3f')}",
            soft_wrap=True,
        )
    if not args.no_plots:
        out = args.out or args.folder
        out.mkdir(parents=True, exist_ok=True)
        for made in (plot_memory(groups, out / "memory_vs_batch.png"), plot_throughput(groups, out / "throughput_vs_batch.png"),
                     plot_accuracy_vs_epsilon(groups, metric, out / "accuracy_vs_epsilon.png")):
            if made is not None:
                console.print(f"[dim]plot: {made}[/]")
    if args.check:
        passed, lines = check(groups, metric)
        console.print("ordering check:" if passed else "[bold red]ordering check failed:[/]")
        for line in lines:
            console.print(line, soft_wrap=True, markup=False)
        return 0 if passed else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

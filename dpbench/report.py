"""`dpbench-report DIR`: a table of every results.json under DIR, and plots.

    dpbench-report outputs/multirun/memory_vs_batch      # table + memory_vs_batch.png (+ accuracy_vs_epsilon.png)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from rich.table import Table

from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE

MIB = 2**20


def load_rows(folder: Path) -> list[dict]:
    """One flat row per results.json under `folder` (unreadable files are reported and skipped)."""
    rows = []
    for path in sorted(folder.rglob(RESULTS_FILE)):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
            continue
        memory, privacy = results.get("memory", {}), results.get("privacy", {})
        rows.append({
            "path": str(path.parent.relative_to(folder)) or ".",
            "algo": results.get("algo"),
            "model": results.get("model"),
            "batch_size": (results.get("config") or {}).get("train", {}).get("batch_size"),
            "peak_mib": memory["peak_bytes"] / MIB if memory.get("peak_bytes") is not None else None,
            "run_mib": (memory["peak_bytes"] - memory["start_bytes"]) / MIB
            if memory.get("peak_bytes") is not None and memory.get("start_bytes") is not None else None,
            "memory_kind": memory.get("kind"),
            "per_sample_grad_bytes": memory.get("per_sample_grad_bytes"),
            "optimizer_state_bytes": memory.get("optimizer_state_bytes"),
            "samples_per_s": results.get("throughput", {}).get("samples_per_s"),
            "accuracy": results.get("metrics", {}).get("best_test_accuracy"),
            "epsilon": privacy.get("epsilon") if privacy.get("private") else None,
            "target_epsilon": privacy.get("target_epsilon"),
            "status": results.get("status"),
        })
    return sorted(rows, key=lambda r: (str(r["algo"]), r["batch_size"] or 0, r["epsilon"] or 0.0))


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def rows_table(rows: list[dict]) -> Table:
    table = Table(title="dpbench results")
    for column in ("algo", "batch", "peak MiB", "run's own MiB", "per-sample grads", "optimizer state", "samples/s", "accuracy", "ε", "status"):
        table.add_column(column, justify="left" if column in ("algo", "status") else "right")
    for r in rows:
        table.add_row(
            str(r["algo"]), _fmt(r["batch_size"], "d"), _fmt(r["peak_mib"], ".1f"), _fmt(r["run_mib"], ".1f"),
            _fmt(None if r["per_sample_grad_bytes"] is None else r["per_sample_grad_bytes"] / MIB, ".2f") + " MiB",
            _fmt(None if r["optimizer_state_bytes"] is None else r["optimizer_state_bytes"] / MIB, ".2f") + " MiB",
            _fmt(r["samples_per_s"], ".1f"), _fmt(r["accuracy"], ".4f"), _fmt(r["epsilon"], ".2f"), str(r["status"]),
        )
    return table


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


def _line_plot(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """One line per algorithm, points sorted by x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=algo)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(rows: list[dict], path: Path) -> Path | None:
    series = defaultdict(list)
    for r in rows:
        if r["batch_size"] is not None and r["peak_mib"] is not None:
            series[r["algo"]].append((r["batch_size"], r["peak_mib"]))
    if not series:
        return None
    kind = next((r["memory_kind"] for r in rows if r["memory_kind"]), "peak")
    return _line_plot(series, "batch size", f"peak memory (MiB, {kind})", "Peak memory vs batch size", path)


def plot_accuracy_vs_epsilon(rows: list[dict], path: Path) -> Path | None:
    """Only when some algorithm ran at several ε; accuracy is averaged over runs at one ε."""
    by_epsilon = defaultdict(dict)
    for r in rows:
        if r["epsilon"] is not None and r["accuracy"] is not None:
            by_epsilon[r["algo"]].setdefault(round(r["epsilon"], 1), []).append(r["accuracy"])
    if not any(len(points) > 1 for points in by_epsilon.values()):
        return None
    series = {algo: [(e, sum(a) / len(a)) for e, a in points.items()] for algo, points in by_epsilon.items()}
    return _line_plot(series, "ε", "best test accuracy (mean over runs)", "Accuracy vs privacy", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpbench-report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="folder searched recursively for results.json")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: the folder)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        console.print(f"[bold red]error:[/] {args.folder} is not a folder; pass the multirun folder, e.g. outputs/multirun/<name>", soft_wrap=True)
        return 2
    rows = load_rows(args.folder)
    if not rows:
        console.print(f"[bold red]error:[/] no {RESULTS_FILE} under {args.folder}; run `dpbench -m ...` first", soft_wrap=True)
        return 2
    console.print(rows_table(rows))
    for r in ratios(rows):
        console.print(
            f"grape/dpadam at batch {r['batch_size']}: peak memory {_fmt(r['peak_mib'], '.3f')} "
            f"(run's own {_fmt(r['run_mib'], '.3f')}), "
            f"per-sample grads {_fmt(r['per_sample_grad_bytes'], '.3f')}, throughput {_fmt(r['samples_per_s'], '.3f')}",
            soft_wrap=True,
        )
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    for made in (plot_memory(rows, out / "memory_vs_batch.png"), plot_accuracy_vs_epsilon(rows, out / "accuracy_vs_epsilon.png")):
        if made is not None:
            console.print(f"[dim]plot: {made}[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The report's figures (matplotlib, headless): accuracy vs ε, memory and throughput vs batch."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from dpbench.report.groups import Group, accuracy_percent


def _title(groups: list[Group], what: str) -> str:
    firsts = [g.first for g in groups]
    parts = [", ".join(sorted({str(r[k]) for r in firsts if r[k]})) for k in ("model", "dataset", "device")]
    return f"{what}\n" + " · ".join(p for p in parts if p)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_epsilon(groups: list[Group], metric: str, path: Path) -> Path | None:
    """Mean ± SE per algorithm over ε; non-private runs as horizontal reference lines."""
    private = defaultdict(list)
    for g in groups:
        if g.first.private and g.first.target_epsilon is not None and g.mean(metric) is not None:
            private[g.first.algo].append(g)
    if not any(len({g.first.target_epsilon for g in gs}) > 1 for gs in private.values()):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, gs in sorted(private.items()):
        gs = sorted(gs, key=lambda g: g.first.target_epsilon)
        ys = [accuracy_percent(g, metric) for g in gs]
        ax.errorbar([g.first.target_epsilon for g in gs], [y for y, _ in ys], yerr=[e or 0 for _, e in ys],
                    marker="o", capsize=3, label=algo)
    for g in groups:
        if not g.first.private and g.mean(metric) is not None:
            ax.axhline(accuracy_percent(g, metric)[0], linestyle="--", color="grey", label=f"{g.first.algo} (non-private)")
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
    if len({g.first.batch_size for g in groups if g.first.batch_size}) < 2:
        return None
    series = defaultdict(list)
    for g in groups:
        y = measure(g)
        if g.first.batch_size and y is not None:
            series[g.first.algo].append((g.first.batch_size, y))
    if not series:
        return None
    plt = pyplot()
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
    pyplot().close(fig)
    return path

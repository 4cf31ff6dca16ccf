"""The report's figures (matplotlib, headless): accuracy vs ε, memory and throughput vs batch."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from dpbench.tools.report.groups import Group, accuracy_percent


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


# ---------------------------------------------------------------- the leaderboard's figures

# Okabe & Ito's colour-blind-safe palette (yellow last: it is faint on white), extended by four of
# Paul Tol's (wine, teal, olive, indigo) for benchmarks of more than eight methods; every method
# also has its own marker, so that it stays distinguishable in grey.
OKABE_ITO = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#56B4E9", "#E69F00", "#F0E442")
PALETTE = OKABE_ITO + ("#882255", "#44AA99", "#999933", "#332288")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p")
# A fixed order, so that a method has the same colour in every figure and every report.
METHOD_ORDER = ("adam", "dpadam", "dpadam_ghost", "dpadam_bk", "dpsgd", "grape", "galore_naive", "dplora",
                "dcdpsgd", "dpdr", "dpzero")


def method_styles(methods) -> dict[str, dict]:
    """Colour and marker of each method present: in METHOD_ORDER (others after them), so one report
    draws a method alike in every figure; up to 12 methods never share a colour or a marker."""
    ordered = [m for m in METHOD_ORDER if m in methods] + sorted(m for m in methods if m not in METHOD_ORDER)
    return {m: {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)]} for i, m in enumerate(ordered)}


def _log_axis(axis) -> None:
    """A log axis labelled with plain numbers (50, 100, 200, 500, ...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _label(entry) -> str:
    return entry.method if entry.private else f"{entry.method} (non-private)"


def _legend_below(fig, handles, labels) -> None:
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=9, frameon=False)


def figure_accuracy_vs_memory(boards):
    """Accuracy (mean ± SE) against own peak memory on a log axis, one panel per ε of one task;
    the private methods' Pareto frontier as a dashed staircase, non-private runs hollow."""
    from dpbench.tools.report.leaderboard import pareto_front

    plt = pyplot()
    styles = method_styles({e.method for b in boards for e in b.entries})
    fig, axes = plt.subplots(1, len(boards), figsize=(max(6.5, 4.6 * len(boards) + 0.6), 4.8), sharey=True, squeeze=False)
    handles = {}
    for ax, board in zip(axes[0], boards):
        for e in board.entries:
            if e.accuracy is None or e.own_mib is None:
                continue
            style = styles[e.method]
            handle = ax.errorbar(e.own_mib, e.accuracy, yerr=e.accuracy_se or 0, linestyle="none", capsize=3,
                                 marker=style["marker"], markersize=8, color=style["color"], markeredgecolor="black",
                                 markerfacecolor="white" if not e.private else style["color"], markeredgewidth=0.8)
            handles.setdefault(_label(e), handle)
            ax.annotate(e.method, (e.own_mib, e.accuracy), xytext=(7, 3), textcoords="offset points", fontsize=7.5, color="#333333")
        front = pareto_front(board)
        if len(front) > 1:
            ax.step([e.own_mib for e in front], [e.accuracy for e in front], where="post", linestyle="--", color="grey", linewidth=1.2)
        if front:
            handles.setdefault("Pareto frontier", ax.plot([], [], linestyle="--", color="grey", label="Pareto frontier")[0])
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        ax.set_title(f"ε = {board.epsilon:g}" if board.epsilon is not None else "non-private", fontsize=11)
        ax.set_xlabel("own peak memory (MiB, log scale)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(f"{boards[0].metric} test {boards[0].metric_name} (%, mean ± SE)", fontsize=10)
    fig.suptitle(f"Accuracy vs memory: {boards[0].task}", fontsize=12)
    _legend_below(fig, list(handles.values()), list(handles))
    fig.tight_layout(rect=(0, 0.09 + 0.045 * ((len(handles) - 1) // 4), 1, 1))
    return fig


def figure_accuracy_vs_epsilon(boards):
    """Accuracy (mean ± SE) against target ε per method (log axis, methods dodged sideways so their
    error bars do not overlap); non-private runs as dashed horizontal lines."""
    plt = pyplot()
    styles = method_styles({e.method for b in boards for e in b.entries})
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    private = [m for m in styles if any(e.method == m and e.private for b in boards for e in b.entries)]
    for i, method in enumerate(private):
        points = sorted((b.epsilon, e) for b in boards for e in b.entries if e.method == method and e.accuracy is not None)
        if not points:
            continue
        dodge = 1.04 ** (i - (len(private) - 1) / 2)
        style = styles[method]
        ax.errorbar([eps * dodge for eps, _ in points], [e.accuracy for _, e in points], yerr=[e.accuracy_se or 0 for _, e in points],
                    marker=style["marker"], color=style["color"], markeredgecolor="black", markeredgewidth=0.6,
                    capsize=3, linewidth=1.2, label=method)
    seen = set()
    for b in boards:
        for e in b.entries:
            if not e.private and e.accuracy is not None and e.method not in seen:
                seen.add(e.method)
                ax.axhline(e.accuracy, linestyle="--", color=styles[e.method]["color"], linewidth=1, label=f"{e.method} (non-private)")
    epsilons = sorted({b.epsilon for b in boards if b.epsilon is not None})
    ax.set_xscale("log")
    ax.set_xticks(epsilons, [f"{eps:g}" for eps in epsilons])
    ax.minorticks_off()
    if len(epsilons) == 1:
        ax.set_xlim(epsilons[0] / 1.6, epsilons[0] * 1.6)
    ax.set_xlabel("target ε", fontsize=10)
    ax.set_ylabel(f"{boards[0].metric} test {boards[0].metric_name} (%, mean ± SE)", fontsize=10)
    ax.set_title(f"Accuracy vs privacy: {boards[0].task}", fontsize=12)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def figure_throughput(boards):
    """Samples per second of each method (mean over the task's ε; throughput does not depend on ε),
    horizontal bars, DP-Adam's as a dotted reference line; a log axis when they span > 30x."""
    from dpbench.tools.report.leaderboard import PRIVATE_REFERENCE

    plt = pyplot()
    speeds: dict[str, list[float]] = defaultdict(list)
    for b in boards:
        for e in b.entries:
            if e.samples_per_s is not None and (e.private or not speeds.get(e.method)):
                speeds[e.method].append(e.samples_per_s)
    styles = method_styles(set(speeds))
    methods = sorted(speeds, key=lambda m: sum(speeds[m]) / len(speeds[m]))
    values = [sum(speeds[m]) / len(speeds[m]) for m in methods]
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(methods) + 1.4))
    ax.barh(methods, values, color=[styles[m]["color"] for m in methods], edgecolor="black", linewidth=0.6)
    for y, v in enumerate(values):
        ax.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (v, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
    if PRIVATE_REFERENCE in speeds:
        ax.axvline(values[methods.index(PRIVATE_REFERENCE)], linestyle=":", color="black", linewidth=1)
    if values and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
    ax.set_xlim(right=max(values) * (3 if ax.get_xscale() == "log" else 1.18))
    ax.set_xlabel("samples / s (higher is faster; dotted: DP-Adam)", fontsize=10)
    ax.set_title(f"Throughput: {boards[0].task}", fontsize=12)
    ax.tick_params(axis="y", labelsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


LEADERBOARD_FIGURES = {
    "accuracy_vs_memory": figure_accuracy_vs_memory,
    "accuracy_vs_epsilon": figure_accuracy_vs_epsilon,
    "throughput": figure_throughput,
}


def figure_bytes(fig, kind: str) -> bytes:
    """The figure as PNG or SVG bytes."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format=kind, dpi=110 if kind == "png" else None, bbox_inches="tight")
    return buffer.getvalue()


def task_slug(task: str) -> str:
    """'digits · vit-micro' -> 'digits_vit-micro': the task's part of a figure's file name."""
    return "_".join(part.strip().replace(" ", "").replace("/", "-") for part in task.split("·"))


def leaderboard_figures(boards) -> dict[str, dict[str, dict[str, bytes]]]:
    """{task: {figure name: {'png': bytes, 'svg': bytes}}} for every task of the boards."""
    by_task = defaultdict(list)
    for b in boards:
        by_task[b.task].append(b)
    out: dict[str, dict[str, dict[str, bytes]]] = {}
    for task, task_boards in by_task.items():
        out[task] = {}
        for name, draw in LEADERBOARD_FIGURES.items():
            fig = draw(task_boards)
            out[task][name] = {kind: figure_bytes(fig, kind) for kind in ("png", "svg")}
            pyplot().close(fig)
    return out

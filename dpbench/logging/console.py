"""The rich console: a live progress bar during training and a summary table at the end."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dpbench.logging.results import EvalRecord, RunResults

# Logs and CI have no terminal width; 120 columns keep the summary tables on one line a row.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def training_progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  acc {task.fields[acc]}  ε {task.fields[eps]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def summary_table(results: RunResults) -> Table:
    """The end-of-run table: the figures of `results.summary()` (the names W&B shows)."""
    figures = results.summary()
    private = figures["privacy/private"]
    table = Table(
        title=f"dpbench · {results.algo} · {results.model} · {results.dataset} · {figures['status']}",
        caption=f"peak memory: {figures['memory/kind']}"
                + ("; best acc*: max over evaluations, selected on test"
                   if figures["test/best_accuracy"] is not None else ""),
    )
    validated = figures["validation/score"] is not None  # a validation split: its noisy score, beside test
    columns = ("test acc", "best acc*", *(("validation (noisy)",) if validated else ()), "ε spent", "δ", "σ",
               "peak memory", "samples/s", "wall time")
    for column in columns:
        table.add_column(column, justify="right")
    peak, wall = figures["memory/peak_bytes"], figures["throughput/wall_s"]
    table.add_row(
        _fmt(figures["test/accuracy"], ".4f"),
        _fmt(figures["test/best_accuracy"], ".4f"),
        *((_fmt(figures["validation/score"], ".4f"),) if validated else ()),
        _fmt(figures["privacy/epsilon"], ".3f") if private else "∞",
        _fmt(figures["privacy/delta"], ".0e") if private else "—",
        _fmt(figures["privacy/noise_multiplier"], ".4f"),
        "—" if peak is None else f"{peak / 2**20:.0f} MiB",
        _fmt(figures["throughput/samples_per_s"], ".1f"),
        "—" if wall is None else f"{wall:.1f} s",
    )
    return table


class ProgressCallback:
    """The live progress bar: loss, accuracy and epsilon spent at each evaluation."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.bar = None

    def on_fit_start(self, trainer) -> None:
        self.progress = training_progress()
        self.progress.start()
        self.bar = self.progress.add_task(
            type(trainer.algorithm).__name__, total=trainer.config.steps, completed=trainer.state.step, loss="—", acc="—",
            eps="0" if trainer.privacy is not None else "∞",
        )

    def on_step(self, trainer, result) -> None:
        self.progress.advance(self.bar)

    def on_eval(self, trainer, record: EvalRecord) -> None:
        if self.progress is None:
            return
        eps = record.epsilon
        self.progress.update(
            self.bar,
            loss=_fmt(record.train_loss, ".3f"),
            acc=_fmt(record.test_accuracy, ".3f"),
            eps="∞" if eps is None else f"{eps:.2f}",
        )

    def on_fit_end(self, trainer) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

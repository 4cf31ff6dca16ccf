"""The rich console: a live progress bar during training and a summary table at the end."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dpbench.logging.results import EvalRecord, RunResults
from dpbench.runtime.metering import own_peak_bytes

OWN_PEAK_RULE = "GPU: max allocated; CPU: peak resident size minus the size at the start"
# Logs and CI have no terminal width; 120 columns keep the summary tables on one line a row.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


LOG_FILE = "cli.log"  # Hydra's job log in the run folder: the console's text is appended to it


def start_console_log() -> None:
    """Record what the console prints from here on (a quiet console, a private trial's, prints nothing)."""
    console.record = True
    console.export_text(clear=True)  # what an earlier job of the process printed is not this one's


def write_console_log(run_dir) -> None:
    """Append what the console printed since `start_console_log` to the run folder's cli.log, as
    plain text (the progress bar's final state, notes, the summary table)."""
    from pathlib import Path

    if not console.record:
        return  # nothing was started: a skipped job
    text = console.export_text(clear=True)
    console.record = False
    if text and run_dir is not None and Path(run_dir).is_dir():
        with open(Path(run_dir) / LOG_FILE, "a", encoding="utf-8") as handle:
            handle.write(text)


def training_progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ε {task.fields[eps]}  acc {task.fields[acc]}  {task.fields[loss_label]}{task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _fmt_eps(epsilon: float | None) -> str:
    return "0" if not epsilon else f"{epsilon:.2f}"


def summary_table(results: RunResults) -> Table:
    """The end-of-run table: the figures of `results.summary()` (the names W&B shows)."""
    figures = results.summary()
    private = figures["privacy/private"]
    table = Table(
        title=f"dpbench · {results.algo} · {results.model} · {results.dataset} · {figures['status']}",
        caption=f"own peak: what the run added ({OWN_PEAK_RULE}); process peak: {figures['memory/kind']} (docs/results.md: memory)"
                + ("; best acc*: max over evaluations, selected on test"
                   if figures["test/best_accuracy"] is not None else ""),
    )
    validated = figures["validation/score"] is not None  # a validation split: its noisy score, beside test
    columns = ("test acc", "best acc*", *(("validation (noisy)",) if validated else ()), "ε spent", "δ", "σ",
               "own peak", "process peak", "samples/s", "wall time")
    for column in columns:
        table.add_column(column, justify="right")
    peak, wall = figures["memory/peak_bytes"], figures["throughput/wall_s"]
    own = own_peak_bytes(results.memory)
    table.add_row(
        _fmt(figures["test/accuracy"], ".4f"),
        _fmt(figures["test/best_accuracy"], ".4f"),
        *((_fmt(figures["validation/score"], ".4f"),) if validated else ()),
        _fmt(figures["privacy/epsilon"], ".3f") if private else "∞",
        _fmt(figures["privacy/delta"], ".0e") if private else "—",
        _fmt(figures["privacy/noise_multiplier"], ".4f"),
        "—" if own is None else f"{own / 2**20:.0f} MiB",
        "—" if peak is None else f"{peak / 2**20:.0f} MiB",
        _fmt(figures["throughput/samples_per_s"], ".1f"),
        "—" if wall is None else f"{wall:.1f} s",
    )
    return table


class ProgressCallback:
    """The live progress bar: the step and ε spent from the first step, test accuracy at each
    evaluation, and the running training loss only where it may be shown (non-private runs, or
    privacy.log_private_stats=true, where it is marked as outside ε)."""

    MIN_INTERVAL_S = 1.0  # ε is recomputed at most this often, and at most 1/10 of the time (slow accountants)

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.bar = None
        self._next_update = 0.0

    def on_fit_start(self, trainer) -> None:
        self.progress = training_progress()
        self.progress.start()
        private = trainer.privacy is not None
        shows_loss = trainer.config.log_private_stats or not private
        self.bar = self.progress.add_task(
            type(trainer.algorithm).__name__, total=trainer.config.steps, completed=trainer.state.step, acc="—",
            eps=_fmt_eps(trainer.epsilon_spent()) if private else "∞",
            loss_label=("loss (outside ε) " if private else "loss ") if shows_loss else "", loss="—" if shows_loss else "",
        )

    def on_step(self, trainer, result) -> None:
        self.progress.advance(self.bar)
        started = time.monotonic()
        if started < self._next_update and trainer.state.step < trainer.config.steps:
            return
        fields = {}
        if trainer.privacy is not None:
            fields["eps"] = _fmt_eps(trainer.epsilon_spent())
        if trainer.state.train_loss is not None:  # None unless it may be shown (log_private_stats)
            fields["loss"] = _fmt(trainer.state.train_loss, ".3f")
        self.progress.update(self.bar, **fields)
        took = time.monotonic() - started
        self._next_update = started + max(self.MIN_INTERVAL_S, 10 * took)

    def on_eval(self, trainer, record: EvalRecord) -> None:
        if self.progress is None:
            return
        self.progress.update(self.bar, acc=_fmt(record.test_accuracy, ".3f"),
                             eps="∞" if record.epsilon is None else _fmt_eps(record.epsilon))

    def on_fit_end(self, trainer) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def grid_table(frame, sweep_dir) -> Table:
    """The end-of-grid table (dpbench.api.load_runs' frame): one row per run of the sweep folder."""
    table = Table(title=f"grid · {sweep_dir}", title_style="bold")
    for name in ("run", "status", "test acc", "validation", "ε spent", "own peak", "process peak", "wall time"):
        table.add_column(name, justify="left" if name in ("run", "status") else "right")
    for figures in frame.sort_values("run_dir").to_dict("records"):
        value = lambda key: None if figures.get(key) != figures.get(key) else figures.get(key)  # NaN: missing
        peak, wall = value("memory/peak_bytes"), value("throughput/wall_s")
        own = own_peak_bytes({"peak_bytes": peak, "start_bytes": value("memory/start_bytes"), "kind": value("memory/kind")})
        table.add_row(
            str(figures["run_dir"]).removeprefix(str(sweep_dir)).lstrip("/") or ".", str(value("status") or "—"),
            _fmt(value("test/accuracy"), ".4f"), _fmt(value("validation/score"), ".4f"),
            "∞" if not value("privacy/private") else _fmt(value("privacy/epsilon"), ".3f"),
            _mib(own), _mib(peak), "—" if wall is None else f"{wall:.1f} s",
        )
    return table


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**20:.0f} MiB"

"""Weights & Biases mirror of results.json. Nothing depends on W&B being reachable.

`logger=wandb` (default) runs offline unless `logger.mode=online` or WANDB_MODE says otherwise;
no account is needed offline (`wandb sync` uploads later). `logger=none` writes nothing.

A job that stops before its results are recorded (Ctrl-C, a crash, a killed process) leaves an
offline run without them. Its W&B run is finished as failed (non-zero exit code) when the process
survives to do it, and the run folder keeps an `UNFINISHED_MARKER` file; when the job runs again,
the unfinished offline runs it left in its own folder are removed before the new attempt starts,
so that `wandb sync` uploads each job once. Runs already synced, and runs dpbench did not start,
are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dpbench.logging.console import console
from dpbench.logging.results import EvalRecord, RunResults, eval_summary


UNFINISHED_MARKER = "dpbench-unfinished"


class NullLogger:
    def log_step(self, step: int, metrics: dict) -> None:
        pass

    def finish(self, results: RunResults, results_file: Path | None = None) -> None:
        return None

    def abort(self, error: BaseException) -> None:
        pass


def remove_unfinished_offline_runs(wandb_dir: Path) -> list[Path]:
    """The offline runs an earlier attempt of this job left unfinished (marked by dpbench, never
    synced): removed, so that `wandb sync` does not upload the job twice."""
    removed = []
    for marker in sorted(Path(wandb_dir).glob(f"offline-run-*/{UNFINISHED_MARKER}")):
        run_folder = marker.parent
        if any(run_folder.glob("*.wandb.synced")):  # already uploaded (as failed): leave it
            continue
        shutil.rmtree(run_folder, ignore_errors=True)
        removed.append(run_folder)
    return removed


class WandbLogger:
    def __init__(self, cfg, run_dir: Path, run_name: str, config: dict, tags: list[str], system_metrics: bool = True):
        import wandb

        mode = os.environ.get("WANDB_MODE") or cfg.mode
        self.offline = mode == "offline"
        if removed := remove_unfinished_offline_runs(run_dir / "wandb"):  # an online rerun replaces them too
            names = ", ".join(folder.name for folder in removed)
            console.print(f"[yellow]note:[/] removed the unfinished offline W&B run(s) of an earlier attempt: {names}",
                          soft_wrap=True)
        self.log_every = max(1, int(cfg.get("log_every") or 1))
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            name=cfg.get("run_name") or run_name,
            tags=tags,
            mode=mode,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
            # system metrics (process memory every 15 s) track realised batch sizes: off where private
            # statistics are not to be logged
            settings=wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=not system_metrics),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.marker = Path(self.run.dir).parent / UNFINISHED_MARKER if self.offline else None
        if self.marker is not None:
            self.marker.write_text("this job stopped before its results were recorded; its next attempt removes this run\n")

    def log_step(self, step: int, metrics: dict) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self, results: RunResults, results_file: Path | None = None) -> str | None:
        """Summary and results.json artifact; returns the `wandb sync` command of an offline run."""
        import wandb

        self.run.summary.update({**results.summary(), "notes": "\n".join(results.notes or [])})
        if results_file is not None and results_file.is_file():
            artifact = wandb.Artifact(f"results-{self.run.id}", type="results")
            artifact.add_file(str(results_file))
            self.run.log_artifact(artifact)
        run_dir = Path(self.run.dir).parent if self.offline else None
        self.run.finish()
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
        return f"wandb sync {run_dir}" if run_dir is not None else None

    def abort(self, error: BaseException) -> None:
        """The job stopped before recording its results: the W&B run ends as failed (130 for Ctrl-C,
        as a shell reports it), and stays marked unfinished."""
        with contextlib.suppress(Exception):  # the job's own error is what the user must see
            self.run.finish(exit_code=130 if isinstance(error, KeyboardInterrupt) else 1)


class LoggerCallback:
    """Trainer callback mirroring steps and evaluations to the logger (W&B or nothing).

    Per-step training loss and realised batch size are un-noised statistics of the private
    batch: logged only when privacy.log_private_stats is on.
    """

    def __init__(self, logger) -> None:
        self.logger = logger

    def on_fit_start(self, trainer) -> None: ...

    def on_step(self, trainer, result) -> None:
        every = getattr(self.logger, "log_every", 1)
        if result.batch_size > 0 and trainer.config.log_private_stats and trainer.state.step % every == 0:
            self.logger.log_step(trainer.state.step, {"train/step_loss": result.loss, "train/batch_size": result.batch_size})

    def on_eval(self, trainer, record: EvalRecord) -> None:
        self.logger.log_step(record.step, eval_summary(record))

    def on_fit_end(self, trainer) -> None: ...


def build_logger(cfg, run_dir: Path, run_name: str, config: dict, tags: list[str] | None = None,
                 system_metrics: bool = True):
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_dir, run_name, config, tags or [], system_metrics)

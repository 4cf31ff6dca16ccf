"""Weights & Biases mirror of results.json. Nothing depends on W&B being reachable.

`logger=wandb` (default) runs offline unless `logger.mode=online` or WANDB_MODE says otherwise;
no account is needed offline (`wandb sync` uploads later). `logger=none` writes nothing.

A job that stops before its results are recorded (Ctrl-C, a crash, a killed process) leaves an
offline run without them. Its W&B run is finished as failed (non-zero exit code) when the process
survives to do it, and the run folder keeps an `UNFINISHED_MARKER` file. When the job resumes from
its checkpoint, it resumes the same W&B run (its id is kept in the run folder, `RUN_ID_FILE`):
online, W&B appends to that run's history; offline, each attempt is a folder of that id and
`wandb sync` of all of them (the command the run prints) uploads them in order into one run. When
the job starts over from step 0 instead, the unfinished offline runs it left in its own folder are
removed first, so that `wandb sync` uploads each job once. Runs already synced, and runs dpbench
did not start, are never touched.

Each run is `job_type="train"`; its results.json and its saved model (`model.safetensors`, a
`model` artifact) are logged as artifacts when it completes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dpbench.logging.console import console
from dpbench.logging.results import EvalRecord, RunResults, eval_summary


UNFINISHED_MARKER = "dpbench-unfinished"
RUN_ID_FILE = "wandb-run-id"  # the W&B run id of the job's attempts (random: nothing of the data)
JOB_TYPE = "train"


class NullLogger:
    def log_step(self, step: int, metrics: dict) -> None:
        pass

    def finish(self, results: RunResults, results_file: Path | None = None) -> None:
        return None

    def abort(self, error: BaseException) -> None:
        pass


def attempt_run_id(run_dir: Path) -> str | None:
    """The W&B run id an earlier attempt of this job used (None: none, or never logged to W&B)."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() or None if path.is_file() else None


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
    def __init__(self, cfg, run_dir: Path, run_name: str, config: dict, tags: list[str], system_metrics: bool = True,
                 resuming: bool = False):
        import wandb

        mode = os.environ.get("WANDB_MODE") or cfg.mode
        self.offline = mode == "offline"
        self.run_dir = Path(run_dir)
        resume_id = attempt_run_id(run_dir) if resuming else None
        if resume_id is None and (removed := remove_unfinished_offline_runs(self.run_dir / "wandb")):
            names = ", ".join(folder.name for folder in removed)  # a fresh start replaces them (online too)
            console.print(f"[yellow]note:[/] removed the unfinished offline W&B run(s) of an earlier attempt: {names}",
                          soft_wrap=True)
        self.log_every = max(1, int(cfg.get("log_every") or 1))
        self.run = wandb.init(
            id=resume_id,
            resume="allow" if resume_id else None,  # the same run: one history across the attempts
            job_type=JOB_TYPE,
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
        (self.run_dir / RUN_ID_FILE).write_text(self.run.id + "\n")
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
            model_file = results_file.parent / "model.safetensors"  # dpbench.saved_model.MODEL_FILE
            if model_file.is_file():
                model = wandb.Artifact(f"model-{self.run.id}", type="model", metadata={"format": "dpbench-model"})
                model.add_file(str(model_file))
                self.run.log_artifact(model)
        run_id = self.run.id
        self.run.finish()
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
        if not self.offline:
            return None
        attempts = sorted(str(folder) for folder in (self.run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
        return f"wandb sync {' '.join(attempts)}"  # every attempt of this run, synced in order into one

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
                 system_metrics: bool = True, resuming: bool = False):
    """`resuming`: the job continues from its checkpoint, so it continues its earlier W&B run."""
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_dir, run_name, config, tags or [], system_metrics, resuming)

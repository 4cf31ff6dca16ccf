"""Weights & Biases mirror of results.json. Nothing depends on W&B being reachable.

`logger=wandb` (default) runs offline unless `logger.mode=online` or WANDB_MODE says otherwise;
no account is needed offline (`wandb sync` uploads later). `logger=none` writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


class NullLogger:
    def log_step(self, step: int, metrics: dict) -> None:
        pass

    def finish(self, results: dict, results_file: Path | None = None) -> None:
        return None


# The W&B run summary: one name per figure, the same names the step logs use (no duplicates).
SUMMARY_KEYS = {
    "test/accuracy": ("metrics", "test_accuracy"),
    "test/best_accuracy": ("metrics", "best_test_accuracy"),
    "test/loss": ("metrics", "test_loss"),
    "train/loss": ("metrics", "train_loss"),
    "privacy/epsilon": ("privacy", "epsilon"),
    "privacy/epsilon_is_upper_bound": ("privacy", "epsilon_is_upper_bound"),
    "privacy/delta": ("privacy", "delta"),
    "privacy/noise_multiplier": ("privacy", "noise_multiplier"),
    "memory/peak_bytes": ("memory", "peak_bytes"),
    "memory/start_bytes": ("memory", "start_bytes"),
    "memory/per_sample_grad_bytes": ("memory", "per_sample_grad_bytes"),
    "memory/optimizer_state_bytes": ("memory", "optimizer_state_bytes"),
    "throughput/samples_per_s": ("throughput", "samples_per_s"),
    "throughput/wall_s": ("throughput", "wall_s"),
}


class WandbLogger:
    def __init__(self, cfg, run_dir: Path, run_name: str, config: dict, tags: list[str]):
        import wandb

        mode = os.environ.get("WANDB_MODE") or cfg.mode
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
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.offline = mode == "offline"

    def log_step(self, step: int, metrics: dict) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self, results: dict, results_file: Path | None = None) -> str | None:
        """Summary and results.json artifact; returns the `wandb sync` command of an offline run."""
        import wandb

        summary = {key: (results.get(section) or {}).get(field) for key, (section, field) in SUMMARY_KEYS.items()}
        self.run.summary.update({**summary, "status": results["status"], "notes": "\n".join(results.get("notes", []))})
        if results_file is not None and results_file.is_file():
            artifact = wandb.Artifact(f"results-{self.run.id}", type="results")
            artifact.add_file(str(results_file))
            self.run.log_artifact(artifact)
        run_dir = Path(self.run.dir).parent if self.offline else None
        self.run.finish()
        return f"wandb sync {run_dir}" if run_dir is not None else None


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

    def on_eval(self, trainer, record: dict) -> None:
        metrics = {"test/accuracy": record["test_accuracy"], "test/loss": record["test_loss"]}
        if record["train_loss"] is not None:
            metrics["train/loss"] = record["train_loss"]
        if record.get("train_accuracy") is not None:
            metrics["train/accuracy"] = record["train_accuracy"]
        if record["epsilon"] is not None:
            metrics["privacy/epsilon"] = record["epsilon"]
        self.logger.log_step(record["step"], metrics)

    def on_fit_end(self, trainer) -> None: ...


def build_logger(cfg, run_dir: Path, run_name: str, config: dict, tags: list[str] | None = None):
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_dir, run_name, config, tags or [])

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

    def finish(self, results: dict) -> None:
        pass


class WandbLogger:
    def __init__(self, cfg, run_dir: Path, run_name: str, config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE") or cfg.mode
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            name=run_name,
            mode=mode,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.define_metric("test/accuracy", summary="max")

    def log_step(self, step: int, metrics: dict) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self, results: dict) -> None:
        privacy, metrics = results["privacy"], results["metrics"]
        self.run.summary.update(
            {
                "test_accuracy": metrics.get("test_accuracy"),
                "best_test_accuracy": metrics.get("best_test_accuracy"),
                "train_loss": metrics.get("train_loss"),
                "epsilon": privacy.get("epsilon"),
                "delta": privacy.get("delta"),
                "noise_multiplier": privacy.get("noise_multiplier"),
                "peak_memory_bytes": results["memory"]["peak_bytes"],
                "per_sample_grad_bytes": results["memory"]["per_sample_grad_bytes"],
                "optimizer_state_bytes": results["memory"]["optimizer_state_bytes"],
                "samples_per_s": results["throughput"].get("samples_per_s"),
                "wall_s": results["throughput"]["wall_s"],
                "status": results["status"],
                "epsilon_is_upper_bound": privacy.get("epsilon_is_upper_bound"),
                "notes": "\n".join(results.get("notes", [])),
            }
        )
        self.run.finish()


class LoggerCallback:
    """Trainer callback mirroring steps and evaluations to the logger (W&B or nothing).

    Per-step training loss and realised batch size are un-noised statistics of the private
    batch: logged only when privacy.log_private_stats is on.
    """

    def __init__(self, logger) -> None:
        self.logger = logger

    def on_fit_start(self, trainer) -> None: ...

    def on_step(self, trainer, result) -> None:
        if result.batch_size > 0 and trainer.config.log_private_stats:
            self.logger.log_step(trainer.state.step, {"train/step_loss": result.loss, "train/batch_size": result.batch_size})

    def on_eval(self, trainer, record: dict) -> None:
        metrics = {"test/accuracy": record["test_accuracy"], "test/loss": record["test_loss"]}
        if record["train_loss"] is not None:
            metrics["train/loss"] = record["train_loss"]
        if record["epsilon"] is not None:
            metrics["privacy/epsilon"] = record["epsilon"]
        self.logger.log_step(record["step"], metrics)

    def on_fit_end(self, trainer) -> None: ...


def build_logger(cfg, run_dir: Path, run_name: str, config: dict):
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_dir, run_name, config)

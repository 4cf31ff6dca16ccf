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
            }
        )
        self.run.finish()


def build_logger(cfg, run_dir: Path, run_name: str, config: dict):
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_dir, run_name, config)

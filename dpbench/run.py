"""Build a run from its config, calibrate the noise, train, and write results.json."""

from __future__ import annotations

import math
import platform
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import dpbench
from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.errors import DivergedError, UserError
from dpbench.logging.console import console, summary_table
from dpbench.logging.results import read_results, write_results
from dpbench.logging.wandb_logger import build_logger
from dpbench.metering import PeakMemory
from dpbench.models import build_model
from dpbench.privacy.accountants import build_accountant, calibrate_noise_multiplier, planned_ledger
from dpbench.privacy.mechanisms import NEIGHBORING_RELATIONS
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.sampling import build_sampler
from dpbench.tasks import build_task
from dpbench.trainer import Trainer


def validate(cfg: DictConfig) -> None:
    """Reject bad input before anything expensive happens, with the fix in the message."""
    p, t = cfg.privacy, cfg.train
    if p.noise_multiplier is None:
        if p.epsilon is None or not p.epsilon > 0:
            raise UserError(f"privacy.epsilon must be positive, got {p.epsilon}; or set privacy.noise_multiplier")
    elif not p.noise_multiplier > 0:
        raise UserError(f"privacy.noise_multiplier must be positive, got {p.noise_multiplier}")
    if p.delta is None or not 0 < p.delta < 1:
        raise UserError(f"privacy.delta must lie strictly between 0 and 1, got {p.delta}")
    if p.clip_norm is None or not p.clip_norm > 0:
        raise UserError(f"privacy.clip_norm must be positive, got {p.clip_norm}")
    if neighboring(cfg) not in NEIGHBORING_RELATIONS:
        raise UserError(f"privacy.neighboring={neighboring(cfg)!r} is not known; use add_remove or replace_one")
    if p.sampling not in ("poisson", "shuffle"):
        raise UserError(f"privacy.sampling={p.sampling!r} is not known; use poisson or shuffle")
    if not t.batch_size or t.batch_size <= 0:
        raise UserError(f"train.batch_size must be a positive integer, got {t.batch_size}")
    if t.physical_batch_size is not None and not 0 < t.physical_batch_size <= t.batch_size:
        raise UserError(
            f"train.physical_batch_size={t.physical_batch_size} must lie in 1..train.batch_size={t.batch_size}"
        )
    if t.steps is None and (t.epochs is None or t.epochs <= 0):
        raise UserError("set train.steps or a positive train.epochs")
    if t.steps is not None and t.steps < 0:
        raise UserError(f"train.steps must be >= 0, got {t.steps}")
    if not t.lr > 0:
        raise UserError(f"train.lr must be positive, got {t.lr}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"device={cfg.device!r} is not known; use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")


def neighboring(cfg: DictConfig) -> str:
    """The neighbouring relation epsilon is stated for (configs without the key: add_remove)."""
    return str(cfg.privacy.get("neighboring", "add_remove"))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Model initialisation and data order only; privacy noise never comes from these RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def planned_steps(cfg: DictConfig, train_size: int) -> int:
    if cfg.train.steps is not None:
        return int(cfg.train.steps)
    return max(1, round(cfg.train.epochs * train_size / cfg.train.batch_size))


def versions(device: torch.device) -> dict:
    import opacus

    return {
        "dpbench": dpbench.__version__,
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }


def run_job(cfg: DictConfig, run_dir: Path, show_progress: bool = True) -> dict:
    """Run one job. Returns its results (also written to run_dir/results.json)."""
    run_dir = Path(run_dir)
    if cfg.resume and (existing := read_results(run_dir)) is not None:
        console.print(f"[dim]results.json exists in {run_dir}: skipping (resume=false reruns it)[/]")
        return existing
    validate(cfg)
    notes: list[str] = []

    def warn(message: str) -> None:
        notes.append(message)
        console.print(f"[yellow]warning:[/] {message}")

    device = resolve_device(cfg.device)
    memory = PeakMemory(device)
    memory.reset()
    started = time.perf_counter()
    seed_everything(cfg.seed)

    task = build_task(cfg, device)
    if hasattr(task, "build_model"):  # language tasks: the model needs the task's tokenizer
        model = task.build_model(cfg.model).to(device)
    else:
        model = build_model(cfg.model, task.model_spec()).to(device)
    model.train()
    algo_cls = algorithm_class(cfg.algo.name)
    n, batch_size = task.train_size, cfg.train.batch_size
    if batch_size > n:
        raise UserError(f"train.batch_size={batch_size} exceeds the {n} training examples; lower it")
    sample_rate = batch_size / n
    steps = planned_steps(cfg, n)

    privacy_cfg = cfg.privacy
    relation = neighboring(cfg)  # the neighbouring relation epsilon is stated for
    accountant = privacy = None
    sigma = None
    if algo_cls.private:
        accountant = build_accountant(cfg.accountant.name)
        if privacy_cfg.delta >= 1 / n:
            warn(f"privacy.delta={privacy_cfg.delta} is not below 1/n = {1 / n:.2e}; such a delta allows leaking a record")
        if privacy_cfg.sampling != "poisson":
            warn("privacy.sampling=shuffle: the accountant's guarantee assumes Poisson sampling, so the reported epsilon is not a proven bound for this run")

        def ledger_for(noise_multiplier: float):
            return planned_ledger(
                lambda step: algo_cls.declared_mechanisms(cfg.algo, noise_multiplier, sample_rate, step, relation),
                steps,
            )

        if privacy_cfg.noise_multiplier is not None:
            sigma = float(privacy_cfg.noise_multiplier)
        elif steps == 0:  # zero-shot evaluation: nothing is released, nothing to calibrate
            sigma = math.inf
        else:
            sigma = calibrate_noise_multiplier(accountant, ledger_for, privacy_cfg.epsilon, privacy_cfg.delta)
        privacy = PrivacySetup(
            noise_multiplier=sigma,
            clip_norm=float(privacy_cfg.clip_norm),
            expected_batch_size=sample_rate * n,
            sample_rate=sample_rate,
            noise=GaussianNoise(device, secure=bool(privacy_cfg.secure_rng)),
            clipping=privacy_cfg.clipping,
            clipping_gamma=float(privacy_cfg.clipping_gamma),
            neighboring=relation,
        )
    algorithm = algo_cls(model, task, cfg.algo, float(cfg.train.lr), privacy)

    sampler = build_sampler(privacy_cfg.sampling, n, batch_size, cfg.seed)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run_name = f"{cfg.algo.name}-{cfg.model.name}-{cfg.dataset.name}-seed{cfg.seed}"
    logger = build_logger(cfg.logger, run_dir, run_name, resolved)
    trainer = Trainer(
        task, algorithm, sampler, steps, cfg.train.physical_batch_size, cfg.train.eval_every,
        accountant, privacy_cfg.delta if accountant else None, logger, show_progress,
    )
    status, failure = "completed", None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
            state = trainer.fit()
        if not state.history:  # train.steps=0: evaluate the untrained (or pretrained) model
            trainer._evaluate()
    except DivergedError as error:
        status, failure = "diverged", error
    state = trainer.state

    epsilon = trainer.epsilon_spent() if accountant else None
    last = state.history[-1] if state.history else {}
    results = {
        "status": status,
        "algo": cfg.algo.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "seed": cfg.seed,
        "privacy": {
            "private": algo_cls.private,
            "epsilon": epsilon,
            "target_epsilon": privacy_cfg.epsilon if (algo_cls.private and privacy_cfg.noise_multiplier is None) else None,
            "delta": privacy_cfg.delta if algo_cls.private else None,
            "noise_multiplier": sigma,
            "clip_norm": privacy_cfg.clip_norm if algo_cls.private else None,
            "sample_rate": sample_rate,
            "expected_batch_size": sample_rate * n,
            "steps": state.step,
            "planned_steps": steps,
            "accountant": cfg.accountant.name if algo_cls.private else None,
            "sampling": privacy_cfg.sampling,
            "neighboring": relation if algo_cls.private else None,
            "ledger": state.ledger.as_records(),
        },
        "metrics": {
            "metric": task.metric_name,  # what test_accuracy holds
            "test_accuracy": last.get("test_accuracy"),
            "best_test_accuracy": state.best_accuracy,
            "train_loss": last.get("train_loss"),
            "test_loss": last.get("test_loss"),
        },
        "memory": {
            **memory.read(),
            "per_sample_grad_bytes": algorithm.per_sample_grad_bytes,
            "optimizer_state_bytes": algorithm.optimizer_state_bytes(),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        },
        "throughput": {**trainer.throughput.summary(), "wall_s": time.perf_counter() - started},
        "algorithm": algorithm.extra_results(),
        "history": state.history,
        "notes": notes,
        "versions": versions(device),
        "config": resolved,
    }
    write_results(run_dir, results)
    logger.finish(results)
    console.print(summary_table(results))
    console.print(f"[dim]results: {run_dir / 'results.json'}[/]")
    if failure is not None:
        raise failure
    return results

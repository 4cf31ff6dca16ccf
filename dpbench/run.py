"""Build a run from its config, calibrate the noise, train, and write results.json."""

from __future__ import annotations

import contextlib
import platform
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import dpbench
from dpbench import distributed
from dpbench.algorithms import Algorithm, algorithm_class
from dpbench.checkpoint import CHECKPOINT_FILE, Checkpointer, CheckpointMismatch, StopSignals, delete_checkpoint, incompatible, read_checkpoint
from dpbench.errors import DivergedError, UserError
from dpbench.logging.console import ProgressCallback, console, summary_table
from dpbench.logging.results import (
    RESULTS_FILE, EvalRecord, MemoryResults, MetricsResults, PrivacyResults, RunResults, ThroughputResults, read_results,
    write_results,
)
from dpbench.logging.wandb_logger import LoggerCallback, build_logger
from dpbench.metering import PeakMemory
from dpbench.precision import Precision, require_native_bf16
from dpbench.privacy.plan import PRIVATE_STATISTIC_FIGURES, PrivacyPlan, plan_privacy
from dpbench.privacy.sampling import batches_per_epoch, build_sampler
from dpbench.schema import RUN_INVARIANT_KEYS, check_keys, default_of
from dpbench.tasks import Task, build_task
from dpbench.trainer import Trainer, TrainerConfig


def validate(cfg: DictConfig) -> None:
    """Reject bad input before anything expensive happens, with the fix in the message. Types and
    choices were checked by Hydra against dpbench/schema.py while it composed; here: values."""
    for note in check_keys(cfg):
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
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
    if t.get("checkpoint_every") is not None and t.checkpoint_every < 1:
        raise UserError(f"train.checkpoint_every must be >= 1 or null (no periodic checkpoints), got {t.checkpoint_every}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")


def resolved_config(cfg: DictConfig) -> dict:
    """The config as plain data (choices as their strings): what results.json, checkpoints and
    W&B store and what resume compares."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


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
    """train.steps, or train.epochs passes of n / B Poisson batches or of the shuffled epoch's batches."""
    if cfg.train.steps is not None:
        return int(cfg.train.steps)
    per_epoch = batches_per_epoch(cfg, train_size) or train_size / cfg.train.batch_size
    return max(1, round(cfg.train.epochs * per_epoch))


PROVENANCE_PACKAGES = ["torch", "opacus", "timm", "transformers", "peft", "hydra-core", "wandb", "dp-accounting", "numpy"]


def git_commit() -> str | None:
    """The commit of the source checkout dpbench runs from (None for an installed wheel)."""
    import subprocess

    root = Path(dpbench.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None


def versions(device: torch.device) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "dpbench": dpbench.__version__,
        **{name.replace("-", "_"): installed(name) for name in PROVENANCE_PACKAGES},
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "git_commit": git_commit(),
        "command": " ".join(sys.argv),
    }


def config_differences(stored: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (ignored keys left out)."""
    keys = sorted(set(stored) | set(current))
    out = []
    for key in keys:
        dotted = f"{prefix}{key}"
        if dotted in RUN_INVARIANT_KEYS:
            continue
        a, b = stored.get(key, "<absent>"), current.get(key, "<absent>")
        if a == "<absent>" and b == default_of(dotted, current.get("name") if prefix == "algo." else None):
            continue  # a key added since the run was stored, left at its default
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, dotted + ".")
        elif a != b:
            out.append(f"{dotted} ({a!r} -> {b!r})")
    return out


def matches_config(stored: dict, cfg: DictConfig, held: str, otherwise: str) -> bool:
    """Whether a stored run (results.json or checkpoint) is of this config; if not, say so."""
    differences = config_differences(stored.get("config") or {}, resolved_config(cfg))
    if differences:
        console.print(f"[yellow]note:[/] {held} of another config ({'; '.join(differences[:4])}); {otherwise}",
                      soft_wrap=True)
    return not differences


def reusable_results(cfg: DictConfig, run_dir: Path) -> RunResults | None:
    """The stored results of this exact job, or None (with the reason printed) to run it."""
    if not cfg.resume or (existing := read_results(run_dir)) is None:
        return None
    if not matches_config(existing, cfg, f"{run_dir} holds a run", "running it again"):
        return None
    console.print(f"[dim]results.json exists in {run_dir}: skipping (resume=false reruns it)[/]")
    return RunResults.from_json(existing)


# what an attempt leaves in its folder (error.txt: dpbench.cli.ERROR_FILE, written for a failed grid job)
EARLIER_ATTEMPT_FILES = (CHECKPOINT_FILE, "wandb", "error.txt", RESULTS_FILE)


def earlier_attempt_note(run_dir: Path) -> str | None:
    """A run starting from step 0 in a folder an earlier attempt used: that attempt's releases (its
    published evaluations, its W&B run) are in no epsilon, and results.json says so."""
    left = [name for name in EARLIER_ATTEMPT_FILES if (Path(run_dir) / name).exists()]
    if not left:
        return None
    return (f"this run started from step 0 in a folder an earlier attempt left ({', '.join(left)}); whatever that "
            "attempt released or published is outside this run's epsilon (their privacy costs add up)")


def resumable_checkpoint(cfg: DictConfig, run_dir: Path) -> dict | None:
    """The checkpoint of this exact job to continue from (same rule as `reusable_results`), or None."""
    if (stored := read_checkpoint(run_dir) if cfg.resume else None) is None:
        return None
    return stored if matches_config(stored, cfg, f"the checkpoint in {run_dir} is", "starting from step 0") else None


class TF32Switch:
    """TF32 (a 10-bit mantissa in fp32 matmuls and convolutions on Ampere and later GPUs) off for
    private runs: per-example norms and clipped sums must be computed in fp32 for the stated
    sensitivity to hold. A non-private run gets the process's own settings back, so in a grid run
    in one process a job's numerics do not depend on the jobs before it. `backends` and
    `torch_module` are seams for tests."""

    def __init__(self, backends=torch.backends, torch_module=torch):
        self.backends, self.torch = backends, torch_module
        self.defaults: tuple | None = None

    def apply(self, private: bool) -> None:
        b = self.backends
        if self.defaults is None:
            self.defaults = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, self.torch.get_float32_matmul_precision())
        matmul, cudnn, matmul_precision = (False, False, "highest") if private else self.defaults
        b.cuda.matmul.allow_tf32 = matmul
        b.cudnn.allow_tf32 = cudnn
        self.torch.set_float32_matmul_precision(matmul_precision)


TF32 = TF32Switch()
LOW_PRECISION = (torch.bfloat16, torch.float16)


def require_fp32_trainable(model: torch.nn.Module, cfg: DictConfig) -> None:
    """Trainable weights in bf16/fp16 have no fp32 master copy: an update below half their
    precision is lost (one DP-Adam step at lr 1e-5 left 84% of bf16 weights bit-identical) and
    Adam's eps 1e-8 is 0 in fp16 (NaN at step 1). Low model.dtype is for frozen weights (LoRA's
    base model); the forward goes low precision through train.precision (autocast)."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype in LOW_PRECISION]
    if low:
        dtype = str(low[0][1]).removeprefix("torch.")
        raise UserError(
            f"model.dtype={cfg.model.get('dtype', dtype)} leaves {len(low)} trainable tensors (e.g. {low[0][0]}) in "
            f"{dtype} with no fp32 master copy, so small updates are lost: set model.dtype=float32, with "
            "train.precision=bf16 (or fp16) for a low-precision forward"
        )


@dataclass
class Job:
    """Everything a run is built from (`setup`), before training."""

    cfg: DictConfig
    device: torch.device
    task: Task
    model: torch.nn.Module
    algorithm: Algorithm
    privacy: PrivacyPlan | None
    steps: int


def setup(cfg: DictConfig) -> Job:
    """Seed, build the task and model, plan privacy (calibrate sigma), build the algorithm."""
    validate(cfg)
    device = resolve_device(cfg.device)
    if str(cfg.train.precision) == "bf16" or str(cfg.model.get("dtype")) == "bfloat16":
        require_native_bf16(device)
    seed_everything(cfg.seed)
    task = build_task(cfg, device)
    model = task.build_model(cfg.model).to(device)
    model.train()
    algo_cls = algorithm_class(cfg.algo.name)
    if cfg.train.batch_size > task.train_size:
        raise UserError(f"train.batch_size={cfg.train.batch_size} exceeds the {task.train_size} training examples; lower it")
    steps = planned_steps(cfg, task.train_size)
    precision = Precision(str(cfg.train.precision), device.type)  # the schema checked the choice
    privacy = plan_privacy(cfg, algo_cls, task.train_size, steps, device) if algo_cls.private else None
    algorithm = algo_cls(model, task, cfg.algo, float(cfg.train.lr), privacy.setup if privacy else None)
    require_fp32_trainable(model, cfg)  # after the algorithm chose what trains (LoRA freezes the base)
    algorithm.use_precision(precision)
    TF32.apply(private=algo_cls.private)
    return Job(cfg, device, task, model, algorithm, privacy, steps)


def fit(job: Job, logger, show_progress: bool, run_dir: Path | None = None,
        checkpoint: dict | None = None) -> tuple[Trainer, str, Exception | None]:
    """Train; a diverged run still returns its trainer so that what it measured is recorded.

    With `run_dir`, checkpoints are written there (train.checkpoint_every; SIGTERM/SIGUSR1 write
    one and raise Preempted) and `checkpoint` (from `resumable_checkpoint`) is continued."""
    cfg = job.cfg
    log_private_stats = job.privacy.log_private_stats if job.privacy else True
    checkpointer = None if run_dir is None else Checkpointer(
        run_dir, resolved_config(cfg), cfg.train.get("checkpoint_every"), StopSignals())
    seeded_sampler = job.privacy is None  # private runs draw their batches from fresh entropy
    trainer = Trainer(
        job.task,
        job.algorithm,
        build_sampler(cfg.privacy.sampling, job.task.train_size, cfg.train.batch_size, cfg.seed, job.privacy is not None,
                      batches_per_epoch(cfg, job.task.train_size)),
        TrainerConfig(job.steps, cfg.train.physical_batch_size, int(cfg.train.eval_every), log_private_stats,
                      int(cfg.train.get("train_eval_size") or 0), replay_sampler=seeded_sampler),
        job.privacy,
        [LoggerCallback(logger)] + ([ProgressCallback()] if show_progress else []),
        checkpointer,
    )
    if checkpoint is not None:
        try:
            trainer.load_state_dict(checkpoint["trainer"])
        except (CheckpointMismatch, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise incompatible(checkpointer.path, str(error).strip("'\"")) from error
        distributed.check_replicas(job.model)  # every rank loaded the same state
        console.print(f"resuming from step {trainer.state.step} of {job.steps} ({checkpointer.path})", soft_wrap=True)
        for note in trainer.resume_notes:
            console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    try:
        with checkpointer.signals if checkpointer else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
            trainer.fit()
    except DivergedError as error:
        return trainer, "diverged", error
    return trainer, "completed", None


def record(job: Job, trainer: Trainer, status: str, memory: PeakMemory, started: float, notes: list[str]) -> RunResults:
    """results.json (the contract reports, resumption and checks read) of what ran."""
    cfg, algorithm, state = job.cfg, job.algorithm, trainer.state
    last = state.history[-1] if state.history else EvalRecord()  # the last evaluation's figures
    if job.privacy is not None:
        privacy = job.privacy.results(state.ledger, state.step, job.steps)
        notes = [*notes, *job.privacy.recorded_notes()]
    else:
        sample_rate = cfg.train.batch_size / job.task.train_size
        privacy = PrivacyResults(private=False, sample_rate=sample_rate, expected_batch_size=sample_rate * job.task.train_size,
                                 steps=state.step, planned_steps=job.steps, ledger=[])
    privacy.sampling = cfg.privacy.sampling
    memory_figures = {
        **memory.read(),
        "per_sample_grad_bytes": algorithm.per_sample_grad_bytes,
        "optimizer_state_bytes": algorithm.optimizer_state_bytes(),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in job.model.parameters()),
    }
    throughput = {**trainer.throughput.summary(), "wall_s": time.perf_counter() - started}
    if job.privacy is not None and not job.privacy.log_private_stats:  # they depend on realised batch sizes
        for values, section in ((memory_figures, "memory"), (throughput, "throughput")):
            values.update(dict.fromkeys(PRIVATE_STATISTIC_FIGURES[section]))
        notes = [*notes, "memory and throughput figures that depend on realised batch sizes ("
                 + ", ".join(f"{s}.{k}" for s, keys in PRIVATE_STATISTIC_FIGURES.items() for k in keys)
                 + ") are withheld, as privacy.log_private_stats is off; the benchmarks measure them"]
    counters = algorithm.unnoised_counters()
    extra = {**algorithm.extra_results(), **counters}
    if job.privacy is not None and not job.privacy.log_private_stats:
        extra = {k: v for k, v in extra.items() if k not in algorithm.unnoised_results and k not in counters}
    return RunResults(
        status=status, algo=cfg.algo.name, model=cfg.model.name, dataset=cfg.dataset.name, seed=cfg.seed,
        privacy=privacy,
        metrics=MetricsResults(
            metric=job.task.metric_name, test_accuracy=last.test_accuracy, best_test_accuracy=state.best_accuracy,
            train_loss=last.train_loss, test_loss=last.test_loss, train_accuracy=last.train_accuracy,
        ),
        memory=MemoryResults.from_json(memory_figures),
        throughput=ThroughputResults.from_json(throughput),
        algorithm=extra,
        history=state.history,
        notes=notes,
        versions=versions(job.device),
        config=resolved_config(cfg),
    )


def run_job(cfg: DictConfig, run_dir: Path, show_progress: bool = True, on_start=None) -> RunResults:
    """Run one job: setup -> fit -> record. Returns its results (also in run_dir/results.json).

    With `resume`, a stored run of the same config is returned as is; `on_start()` is called only
    when the job actually runs."""
    run_dir = Path(run_dir)
    distributed.init_from_environment()  # torchrun: join the ranks (a no-op otherwise)
    main = distributed.is_main_process()  # rank 0 alone decides, writes, logs and prints
    if (existing := distributed.broadcast_object(reusable_results(cfg, run_dir) if main else None)) is not None:
        return existing
    distributed.require_data_parallel(algorithm_class(cfg.algo.name), cfg.algo.name)
    if on_start is not None and main:
        on_start()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    distributed.bind_device(resolve_device(cfg.device))  # torchrun + CUDA: this rank's GPU
    memory = PeakMemory(resolve_device(cfg.device))
    memory.reset()
    started = time.perf_counter()
    checkpoint = resumable_checkpoint(cfg, run_dir)  # before setup: a damaged file fails fast
    # every rank resumes from rank 0's choice, or none starts
    distributed.check_same_as_rank_zero("checkpoint to resume", {"step": None if checkpoint is None else checkpoint["step"]})
    earlier = earlier_attempt_note(run_dir) if checkpoint is None and main else None
    job, setup_error = None, None
    try:
        job = setup(cfg)
    except Exception as error:  # noqa: BLE001 - torchrun: every rank stops with it
        setup_error = error
    distributed.raise_together(setup_error, "in setup")
    distributed.check_replicas(job.model)
    distributed.check_same_as_rank_zero("privacy plan", job.privacy.fingerprint() if job.privacy else {"private": False})
    for message in job.privacy.notes if job.privacy else []:
        console.print(f"[yellow]note:[/] {message}", soft_wrap=True)
    run_name = f"{cfg.algo.name}-{cfg.model.name}-{cfg.dataset.name}-seed{cfg.seed}"
    epsilon = f"eps={cfg.privacy.epsilon}" if job.privacy and job.privacy.target_epsilon else "eps=fixed-sigma"
    tags = [f"algo={cfg.algo.name}", f"model={cfg.model.name}", f"dataset={cfg.dataset.name}",
            epsilon if job.privacy else "non-private"]
    logger_cfg = cfg.logger if main else OmegaConf.create({"name": "none"})
    logger = build_logger(logger_cfg, run_dir, run_name, resolved_config(cfg), tags,
                          system_metrics=job.privacy is None or job.privacy.log_private_stats)
    try:
        trainer, status, failure = fit(job, logger, show_progress and main, run_dir, checkpoint)
    except BaseException as error:  # Ctrl-C or a crash: the W&B run ends as failed, not as finished
        logger.abort(error)
        raise
    results = record(job, trainer, status, memory, started,
                     notes=list(trainer.resume_notes) + ([earlier] if earlier and job.privacy is not None else []))
    results.throughput.world_size = distributed.world_size()  # samples_per_s is over all ranks
    results.resumed_from_step = trainer.resumed_from_step
    results_file, write_error = None, None
    if main:
        try:
            results_file = write_results(run_dir, results)
            delete_checkpoint(run_dir)  # results.json now holds the run; a rerun skips it
        except Exception as error:  # noqa: BLE001 - every rank stops with it
            write_error = error
    distributed.raise_together(write_error, "writing results.json")  # the others return once it is written
    if not main:
        if failure is not None:
            raise failure
        return results
    if sync := logger.finish(results, results_file):
        console.print(f"[dim]W&B offline run: upload it with `{sync}`[/]", soft_wrap=True)
    console.print(summary_table(results))
    console.print(f"[dim]results: {results_file}[/]")
    if failure is not None:
        raise failure
    return results

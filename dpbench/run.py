"""Build a run from its config, calibrate the noise, train, and write results.json.

The input checks are in run_config.py, resuming in resume.py, the software and hardware recorded
in provenance.py, the fp32 rules (TF32, master weights) in precision.py."""

from __future__ import annotations

import contextlib
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from dpbench import saved_model
from dpbench.runtime import distributed, sharding
from dpbench.algorithms import ALGORITHMS, Algorithm, algorithm_class
from dpbench.algorithms.compute import ComputeTally, planned_chunks, steps_for_budget
from dpbench.algorithms.learning_rates import mark_head
from dpbench.runtime.algorithm_state import CheckpointMismatch
from dpbench.runtime.checkpoint import Checkpointer, StopSignals, delete_checkpoint, incompatible
from dpbench.errors import DivergedError, UserError
from dpbench.logging.console import ProgressCallback, console, start_console_log, summary_table, write_console_log
from dpbench.logging.results import (
    ComputeResults, EvalRecord, MemoryResults, MetricsResults, PrivacyResults, RunResults, ThroughputResults, epsilon_covers,
    write_results,
)
from dpbench.logging.wandb_logger import LoggerCallback, build_logger
from dpbench.runtime.metering import PeakMemory
from dpbench.runtime.warmup import warm_up
from dpbench.models import ModelFamily, family_of
from dpbench.models.user import check_first_forward
from dpbench.models.user_checks import check_user_model
from dpbench.precision import TF32, Precision, require_fp32_trainable, require_native_bf16
from dpbench.privacy.plan import PRIVATE_STATISTIC_FIGURES, PrivacyPlan, plan_privacy
from dpbench.privacy.validation import validation_score
from dpbench.privacy.sampling import batches_per_epoch, build_sampler
from dpbench.provenance import versions
from dpbench.resume import earlier_attempt_note, resumable_checkpoint, reusable_results
from dpbench.run_config import resolved_config, validate
from dpbench.schema import preset_fallbacks
from dpbench.tasks import Task, build_task
from dpbench.runtime.trainer import Trainer, TrainerConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Model initialisation and data order only; privacy noise never comes from these RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def planned_per_example(cfg: DictConfig) -> float:
    """Forward-pass equivalents a step of this run plans per example: the algorithm's declaration
    (algorithms/compute.py) at the physical chunks of a batch of the expected size."""
    chunks = planned_chunks(int(cfg.train.batch_size), cfg.train.get("physical_batch_size"))
    return algorithm_class(cfg.algo.name).forward_equivalents_per_example(cfg.algo, chunks)


def planned_steps(cfg: DictConfig, train_size: int) -> int:
    """train.steps, or train.epochs passes of n / B Poisson batches or of the shuffled epoch's batches
    (n: the public planning size; a batch larger than it is refused, as q = B / n must be <= 1).
    train.compute_budget, when set, wins over both: the steps whose planned forward-pass
    equivalents come to the budget per training example (public: n, B and the declaration)."""
    if cfg.train.batch_size > train_size:
        raise UserError(f"train.batch_size={cfg.train.batch_size} exceeds the {train_size} training examples; lower it")
    budget = cfg.train.get("compute_budget")
    if budget is not None:
        if not budget > 0:
            raise UserError(f"train.compute_budget={budget} must be positive (forward-pass equivalents per training example)")
        return steps_for_budget(float(budget), train_size, int(cfg.train.batch_size), planned_per_example(cfg))
    if cfg.train.steps is not None:
        return int(cfg.train.steps)
    per_epoch = batches_per_epoch(cfg, train_size) or train_size / cfg.train.batch_size
    return max(1, round(cfg.train.epochs * per_epoch))


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


def setup(cfg: DictConfig, prepare_model: Callable[[torch.nn.Module], None] | None = None,
          prepare_task: Callable[[Task], Task] | None = None) -> Job:
    """Seed, build the task and model, plan privacy (calibrate sigma), build the algorithm.
    `prepare_model` and `prepare_task` (dpbench-audit's one-run canaries: their layer, their
    dataset) see the model and the task first."""
    validate(cfg)
    sharding.check_supported(cfg, ALGORITHMS)  # train.sharding=fsdp: one line naming what is supported
    device = resolve_device(cfg.device)
    if str(cfg.train.precision) == "bf16" or str(cfg.model.get("dtype")) == "bfloat16":
        require_native_bf16(device)
    seed_everything(cfg.seed)
    task = build_task(cfg, device)
    if prepare_task is not None:
        task = prepare_task(task)
    model = task.build_model(cfg.model).to(device)
    model.train()
    check_first_forward(cfg, task, model)  # a user's model or data: one forward, before any other work
    check_user_model(cfg, task, model)  # a user's model (model.builder): the per-example checks, before training
    if prepare_model is not None:
        prepare_model(model)
    if sharding.requested(cfg) != sharding.NONE:  # train.sharding=fsdp: sharded before the algorithm is built
        distributed.check_replicas(model)  # whole tensors, before each rank keeps only its shard
        sharding.shard_model(model, sharding.block_patterns(str(cfg.model.name)), device)
    mark_head(model, (family_of(model) or ModelFamily()).trained_modules, float(cfg.train.get("head_lr_scale", 1.0)),
              str(cfg.model.name))  # train.head_lr_scale: before the algorithm builds its optimizer
    algo_cls = algorithm_class(cfg.algo.name)
    n = task.planning_size  # public: with a validation split n (1 - f), never the realised part's size
    steps = planned_steps(cfg, n)
    precision = Precision(str(cfg.train.precision), device.type)  # the schema checked the choice
    privacy = plan_privacy(cfg, algo_cls, n, steps, device) if algo_cls.private else None
    algorithm = algo_cls(model, task, cfg.algo, float(cfg.train.lr), privacy.setup if privacy else None)
    require_fp32_trainable(model, cfg)  # after the algorithm chose what trains (LoRA freezes the base)
    algorithm.use_precision(precision)
    for note in algorithm.run_notes if privacy else []:
        privacy.note(note)  # printed by run_job, kept in results.json's notes
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
        run_dir, resolved_config(cfg), cfg.train.get("checkpoint_every"), StopSignals(),
        sharded=sharding.requested(cfg) != sharding.NONE, at_evaluations=bool(cfg.train.get("checkpoint", True)))
    seeded_sampler = job.privacy is None  # private runs draw their batches from fresh entropy
    trainer = Trainer(
        job.task,
        job.algorithm,
        # over the realised training part, at the planned q = B / n and epoch length (public sizes)
        build_sampler(cfg.privacy.sampling, job.task.train_size, cfg.train.batch_size, cfg.seed, job.privacy is not None,
                      batches_per_epoch(cfg, job.task.planning_size), sample_rate=cfg.train.batch_size / job.task.planning_size,
                      relation=str(cfg.privacy.get("neighboring", "add_remove"))),
        TrainerConfig(job.steps, cfg.train.physical_batch_size, int(cfg.train.eval_every), log_private_stats,
                      int(cfg.train.get("train_eval_size") or 0), replay_sampler=seeded_sampler,
                      evaluate_test=bool(cfg.train.get("evaluate_test", True))),
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
        checkpointer.saved_step = trainer.state.step
        console.print(f"resuming from step {trainer.state.step} of {job.steps} ({checkpointer.path})", soft_wrap=True)
        for note in trainer.resume_notes:
            console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    try:
        with checkpointer.signals if checkpointer else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
            trainer.fit()
    except DivergedError as error:
        return trainer, "diverged", error
    except KeyboardInterrupt:  # Ctrl-C: say where the same command continues (cli.py prints the rest)
        if checkpointer is not None and distributed.is_main_process():
            console.print(f"[bold yellow]{checkpointer.interrupted_message(trainer.state.step, job.steps)}[/]",
                          soft_wrap=True)
        raise
    finally:  # what runs after training (score, saved model, results) reads each rank's shards only
        sharding.reshard(job.model)
    return trainer, "completed", None


def record(job: Job, trainer: Trainer, status: str, memory: PeakMemory, started: float, notes: list[str],
           score: float | None = None) -> RunResults:
    """results.json (the contract reports, resumption and checks read) of what ran."""
    cfg, algorithm, state = job.cfg, job.algorithm, trainer.state
    last = state.history[-1] if state.history else EvalRecord()  # the last evaluation's figures
    if job.privacy is not None:
        privacy = job.privacy.results(state.ledger, state.step, job.steps)
        notes = [*notes, *job.privacy.recorded_notes()]
    else:
        sample_rate = cfg.train.batch_size / job.task.planning_size
        privacy = PrivacyResults(private=False, sample_rate=sample_rate, expected_batch_size=sample_rate * job.task.planning_size,
                                 steps=state.step, planned_steps=job.steps, ledger=[])
    privacy.sampling = cfg.privacy.sampling
    memory_figures = {
        **memory.read(),
        "per_sample_grad_bytes": algorithm.per_sample_grad_bytes,
        "optimizer_state_bytes": algorithm.optimizer_state_bytes(),
        "parameter_bytes": sharding.local_bytes(job.model.parameters()),  # this rank's shards when sharded
    }
    throughput = {**trainer.throughput.summary(), "wall_s": time.perf_counter() - started}
    compute = compute_figures(job, privacy)
    if job.privacy is not None and not job.privacy.log_private_stats:  # they depend on realised batch sizes
        for values, section in ((memory_figures, "memory"), (throughput, "throughput"), (compute, "compute")):
            values.update(dict.fromkeys(PRIVATE_STATISTIC_FIGURES[section]))
        notes = [*notes, "memory and throughput figures that depend on realised batch sizes or on what ran before "
                 "in the process (" + ", ".join(f"{s}.{k}" for s, keys in PRIVATE_STATISTIC_FIGURES.items() for k in keys)
                 + ") are withheld, as privacy.log_private_stats is off; the benchmarks measure them"]
    counters = algorithm.unnoised_counters()
    extra = {**algorithm.extra_results(), **counters}
    if job.privacy is not None and not job.privacy.log_private_stats:
        extra = {k: v for k, v in extra.items() if k not in algorithm.unnoised_results and k not in counters}
    results = RunResults(
        status=status, algo=cfg.algo.name, model=cfg.model.name, dataset=cfg.dataset.name, seed=cfg.seed,
        privacy=privacy,
        metrics=MetricsResults(
            metric=job.task.metric_name, test_accuracy=last.test_accuracy, best_test_accuracy=state.best_accuracy,
            train_loss=last.train_loss if state.history else state.train_loss, test_loss=last.test_loss,
            train_accuracy=last.train_accuracy, validation_score=score,
            validation_size=job.task.split.planned_validation_size if job.task.split is not None else None,
        ),
        memory=MemoryResults.from_json(memory_figures),
        throughput=ThroughputResults.from_json(throughput),
        compute=ComputeResults.from_json(compute),
        algorithm=extra,
        history=state.history,
        notes=notes,
        versions=versions(job.device),
        config=resolved_config(cfg),
    )
    results.epsilon_covers = epsilon_covers(results, job.privacy is None or job.privacy.log_private_stats,
                                            [*algorithm.unnoised_results, *counters], PRIVATE_STATISTIC_FIGURES)
    results.throughput.world_size = distributed.world_size()  # samples_per_s is over all ranks
    if sharding.requested(cfg) != sharding.NONE:
        results.throughput.sharding = sharding.requested(cfg)  # memory figures are then rank 0's shards
    results.resumed_from_step = trainer.resumed_from_step
    return results


def compute_figures(job: Job, privacy: PrivacyResults) -> dict:
    """results.json's `compute`: the passes the steps ran (summed over the ranks) and the plan."""
    tally = ComputeTally()  # every rank's passes summed
    tally.load(distributed.all_reduce_scalars(*job.algorithm.compute.state()))
    planned = planned_per_example(job.cfg)
    return {
        "forward_equivalents": tally.forward_equivalents, "per_example": tally.per_example,
        "forwards": tally.forwards, "backwards": tally.backwards, "examples": tally.examples,
        "planned_per_example": planned,
        "planned_forward_equivalents": planned * privacy.expected_batch_size * privacy.planned_steps,
        "budget": job.cfg.train.get("compute_budget"),
    }


def keep_model(job: Job, run_dir: Path, results: RunResults) -> None:
    """model.safetensors (dpbench/saved_model.py); a sharded run's model is split over the ranks: not kept yet."""
    if sharding.requested(job.cfg) != sharding.NONE:
        results.notes = [*(results.notes or []), "the model of a sharded run (train.sharding=fsdp) is not saved: model.safetensors "
                             "holds whole tensors, and gathering the shards is not implemented"]
        return
    saved_model.save_model(job.model, job.cfg, results.config, run_dir)


@dataclass
class Ranks:
    """This process's place among torchrun's ranks (one process: the only rank). Rank 0 alone
    decides, writes, logs and prints; `together` makes every rank leave a block at once."""

    main: bool

    @classmethod
    def join(cls) -> "Ranks":
        distributed.init_from_environment()  # torchrun: join the ranks (a no-op otherwise)
        return cls(distributed.is_main_process())

    def decided(self, decide: Callable[[], object]):
        """Rank 0's decision (`decide()` runs there only), the same on every rank."""
        return distributed.broadcast_object(decide() if self.main else None)

    @contextlib.contextmanager
    def together(self, where: str):
        """Every rank leaves the block together: if any failed in it, each raises (raise_together)."""
        error = None
        try:
            yield
        except Exception as failure:  # noqa: BLE001 - torchrun: every rank stops with it
            error = failure
        distributed.raise_together(error, where)

    @staticmethod
    def agree_on(job: Job) -> None:
        """The ranks built the same model and planned the same privacy (rank 0's)."""
        distributed.check_replicas(job.model)
        distributed.check_same_as_rank_zero("privacy plan", job.privacy.fingerprint() if job.privacy else {"private": False})


def prepare(cfg: DictConfig, ranks: Ranks, on_start) -> None:
    """Before setup: refuse what the ranks cannot run (one line each), then bind the device."""
    sharding.check_supported(cfg, ALGORITHMS)  # before require_data_parallel: names what train.sharding=fsdp supports
    distributed.require_data_parallel(algorithm_class(cfg.algo.name), cfg.algo.name)
    if on_start is not None and ranks.main:
        on_start()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    distributed.bind_device(resolve_device(cfg.device))  # torchrun + CUDA: this rank's GPU


def resume_point(cfg: DictConfig, run_dir: Path, ranks: Ranks) -> tuple[dict | None, str | None]:
    """The checkpoint to resume (every rank resumes from rank 0's choice, or none starts) and, for a
    fresh start, the note about an earlier attempt in run_dir."""
    checkpoint = resumable_checkpoint(cfg, run_dir)  # before setup: a damaged file fails fast
    distributed.check_same_as_rank_zero("checkpoint to resume", {"step": None if checkpoint is None else checkpoint["step"]})
    return checkpoint, earlier_attempt_note(run_dir) if checkpoint is None and ranks.main else None


def budget_notes(job: Job) -> list[str]:
    """What train.compute_budget decided (the steps), said once at the start and kept in results.json."""
    budget = job.cfg.train.get("compute_budget")
    if budget is None:
        return []
    steps = f"{job.steps} step" + ("" if job.steps == 1 else "s")
    return [f"train.compute_budget={budget:g} forward-pass equivalents per training example: {steps} of "
            f"{job.cfg.train.batch_size} expected examples at {planned_per_example(job.cfg):g} each "
            "(algo's declared cost; train.steps and train.epochs are not used)"]


def job_logger(job: Job, run_dir: Path, ranks: Ranks, resuming: bool = False):
    """The run's logger (rank 0's; the others log nothing), named and tagged by the run."""
    cfg = job.cfg
    for message in [*(job.privacy.notes if job.privacy else []), *budget_notes(job)]:
        console.print(f"[yellow]note:[/] {message}", soft_wrap=True)
    run_name = f"{cfg.algo.name}-{cfg.model.name}-{cfg.dataset.name}-seed{cfg.seed}"
    epsilon = f"eps={job.privacy.target_epsilon:g}" if job.privacy and job.privacy.target_epsilon else "eps=fixed-sigma"  # issue 43: the target used
    tags = [f"algo={cfg.algo.name}", f"model={cfg.model.name}", f"dataset={cfg.dataset.name}",
            epsilon if job.privacy else "non-private"]
    logger_cfg = cfg.logger if ranks.main else OmegaConf.create({"name": "none"})
    return build_logger(logger_cfg, run_dir, run_name, resolved_config(cfg), tags, resuming=resuming,
                        system_metrics=job.privacy is None or job.privacy.log_private_stats)


def write_run(job: Job, run_dir: Path, results: RunResults, status: str) -> Path:
    """The run's folder (rank 0): the model, once the ledger is complete and record() computed the
    run's epsilon, before results.json, so that a run folder with results.json has its model; then
    results.json, and the checkpoint goes (a rerun skips the run)."""
    if status == "completed" and saved_model.wanted(job.cfg):
        keep_model(job, run_dir, results)
    results_file = write_results(run_dir, results)
    delete_checkpoint(run_dir)
    return results_file


def run_job(cfg: DictConfig, run_dir: Path, show_progress: bool = True, on_start=None) -> RunResults:
    """Run one job: setup -> fit -> score -> record. Returns its results (also in run_dir/results.json).

    With `resume`, a stored run of the same config is returned as is; `on_start()` is called only
    when the job actually runs. Under torchrun every rank runs it; a failure on one stops all.
    What the console printed is appended to the run folder's cli.log (rank 0's)."""
    try:
        return _run_job(cfg, run_dir, show_progress, on_start)
    finally:  # the console's text since the job started (a skipped job writes nothing)
        write_console_log(run_dir if int(os.environ.get("RANK", "0")) == 0 else None)


def _run_job(cfg: DictConfig, run_dir: Path, show_progress: bool, on_start) -> RunResults:
    run_dir, ranks = Path(run_dir), Ranks.join()
    if (existing := ranks.decided(lambda: reusable_results(cfg, run_dir))) is not None:
        return existing
    prepare(cfg, ranks, on_start)
    start_console_log()
    memory = PeakMemory(resolve_device(cfg.device))
    warm_up(cfg)  # what the first job of a process would pay alone (imports, first kernels): every job pays it
    memory.warmed_up = True
    memory.reset()
    started = time.perf_counter()
    checkpoint, earlier = resume_point(cfg, run_dir, ranks)
    with ranks.together("in setup"):
        job = setup(cfg)
    ranks.agree_on(job)
    logger = job_logger(job, run_dir, ranks, resuming=checkpoint is not None)
    try:
        trainer, status, failure = fit(job, logger, show_progress and ranks.main, run_dir, checkpoint)
    except BaseException as error:  # Ctrl-C or a crash: the W&B run ends as failed, not as finished
        logger.abort(error)
        raise
    score = None
    with ranks.together("scoring the validation split"):
        if status == "completed":
            score = validation_score(job.task, job.model, job.privacy, trainer.state.ledger.add_release,
                                     job.algorithm.release_observer, job.device)  # once, on the final model (charged)
    results = record(job, trainer, status, memory, started,
                     notes=[*preset_fallbacks(cfg), *budget_notes(job), *trainer.resume_notes]
                     + ([earlier] if earlier and job.privacy is not None else []),
                     score=score)
    results_file = None
    with ranks.together("writing results.json"):  # the others return once it is written
        results_file = write_run(job, run_dir, results, status) if ranks.main else None
    if ranks.main:
        if sync := logger.finish(results, results_file):
            console.print(f"[dim]W&B offline run: upload it with `{sync}`[/]", soft_wrap=True)
        console.print(summary_table(results))
        console.print(f"[dim]results: {results_file}[/]")
    if failure is not None:
        raise failure
    return results

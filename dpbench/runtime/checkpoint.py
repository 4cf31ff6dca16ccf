"""Checkpoints of a run in progress, and the preemption signals that trigger them.

`checkpoint.pt` is written into the run folder after every evaluation (train.checkpoint=true, the
default) and also every N steps with `train.checkpoint_every=N`; SIGTERM or SIGUSR1 (what SLURM sends before preemption or the time limit) lets
the current step finish, writes one and stops the process with exit status 75. Rerunning the same
command (same run folder, same config) continues from it; the file is deleted once results.json
is written. A checkpoint is internal, never a release: the one model a run releases is
`model.safetensors` (dpbench/saved_model.py), written once its epsilon is final.

What a checkpoint holds (torch.save of plain containers and tensors, read back with
`weights_only=True`): the trainer's step counter, privacy ledger, history, window loss and
throughput counters; the epoch in progress of a shuffled sampler; every rank's seeded RNG states
(torch, CUDA, numpy, random; restored per rank); and the algorithm's state, `algorithm_state()`
(algorithm_state.py: trainable parameters and buffers, optimizer state, the attributes its class lists in
`checkpoint_attributes`: an algorithm only declares what to keep, that module saves it). Frozen parameters are not stored: they are rebuilt from the config
and seed, and a fingerprint of them is checked on load. The entropy-seeded privacy noise and
Poisson sampler are NOT restored: a resumed run draws fresh, independent randomness, which is what
the accountant assumes of every step anyway. A shuffled run's epoch in progress is restored so
that no example is in two batches of one epoch (the bound of `ShuffledLedger` counts epochs).

Why a checkpoint also follows every evaluation: an evaluation published (console, W&B) after the
last checkpoint depends on noisy releases that a resumed run would discard and redo, so its
epsilon would be missing from the resumed ledger.

Sharded runs (`train.sharding=fsdp`, dpbench/runtime/sharding.py) hold 1/K of the model and optimizer
state on each rank, so rank 0 alone cannot write them. There the model and optimizer state go
through `torch.distributed.checkpoint` (DCP: `get_state_dict` of the FSDP2 model and its
optimizer, `dcp.save`) into a fresh folder `checkpoint-shards/step-<k>-<token>/`, each rank writing
its own shards (`__<rank>_0.distcp`; rank 0 also writes DCP's `.metadata`). Once every rank has
finished, rank 0 writes `checkpoint.pt` as for any run (step, ledger, history, sampler, every
rank's generators and every rank's `checkpoint_attributes`) naming that folder, and only then
deletes the other folders under `checkpoint-shards/`. `checkpoint.pt` is the one "latest": an
interrupted save leaves at most an unreferenced folder (removed by the next save), never a
`checkpoint.pt` naming incomplete shards. The ranks must share the run folder's file system.

A sharded checkpoint resumes under another number of ranks too: DCP reads each rank's rows of
every DTensor from whichever files hold them (resharding is the format's purpose, and nothing
else in the run depends on K: each coordinate is released once with N(0, sigma^2 C^2) whatever
the number of shards). The seeded generators and the per-rank attributes then come from rank 0,
and the run's notes say so (`restore_rank_rng_states`).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from dpbench.errors import UserError
from dpbench.paths import atomic_write
from dpbench.runtime import distributed
from dpbench.runtime.algorithm_state import sharded_algorithm_entry, save_sharded_state

CHECKPOINT_FILE = "checkpoint.pt"
SHARDS_DIR = "checkpoint-shards"  # train.sharding=fsdp: DCP folders (the one checkpoint.pt names is the latest)
FORMAT = "dpbench-checkpoint"
FORMAT_VERSION = 1
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on request, rerun the same command to resume


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGUSR1 after writing its checkpoint (`path`), sharded or not."""

    def __init__(self, signal_name: str, step: int, path: Path):
        super().__init__(f"{signal_name} received: stopped after step {step} with a checkpoint in {path}; "
                         "rerun the same command to resume")
        self.step, self.path = step, path


# --- the file ---------------------------------------------------------------------------------
def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_FILE


def write_checkpoint(run_dir: Path, payload: dict) -> Path:
    """Atomically: a reader sees the previous checkpoint or the new one."""
    stamped = {"format": FORMAT, "version": FORMAT_VERSION, **payload}
    return atomic_write(checkpoint_path(run_dir), lambda handle: torch.save(stamped, handle), binary=True)


def shards_root(run_dir: Path) -> Path:
    return Path(run_dir) / SHARDS_DIR


def read_checkpoint(run_dir: Path) -> dict | None:
    """The checkpoint in `run_dir` (None when there is none); a damaged one is a UserError. A
    sharded one's algorithm state gets the absolute `path` of the DCP folder it names."""
    path = checkpoint_path(run_dir)
    if not path.is_file():
        return None
    fix = f"delete {path} (or set resume=false) to start the run over"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated, not a torch file, unpickling refused
        raise UserError(f"checkpoint {path} is unreadable ({type(error).__name__}); {fix}") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not a dpbench checkpoint; {fix}")
    if payload.get("version") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} has format version {payload.get('version')}, this dpbench reads "
                        f"{FORMAT_VERSION}; {fix}")
    algorithm = (payload.get("trainer") or {}).get("algorithm") or {}
    if isinstance(algorithm, dict) and isinstance(algorithm.get("sharded"), dict):
        folder = shards_root(run_dir) / str(algorithm["sharded"].get("folder"))
        if not (folder / ".metadata").is_file():
            raise UserError(f"checkpoint {path} names the sharded state {folder}, which is missing or incomplete; {fix}")
        algorithm["sharded"]["path"] = str(folder)
    return payload


def delete_checkpoint(run_dir: Path) -> None:
    """checkpoint.pt first (so no checkpoint names a half-deleted folder), then any sharded state."""
    checkpoint_path(run_dir).unlink(missing_ok=True)
    shutil.rmtree(shards_root(run_dir), ignore_errors=True)


def incompatible(path: Path, what: str) -> UserError:
    """The one-line error for a checkpoint that does not fit the run being built."""
    return UserError(f"checkpoint {path} does not fit this run ({what}); delete it or set resume=false to start over")


# --- seeded RNG states ---------------------------------------------------------------------------
def rng_states() -> dict:
    """This process's experiment-seeded generators (model init, dropout, augmentation, data order)."""
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if distributed.run_uses_cuda() else [],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        "random": random.getstate(),
    }


def restore_rng_states(states: dict) -> list[str]:
    """Restore one process's `rng_states()`. The CUDA states are restored only onto as many GPUs as
    they were taken from (a state belongs to its device); otherwise they are left, and the returned
    note says so (the run goes on: privacy never depends on these generators)."""
    torch.set_rng_state(states["torch"])
    notes = []
    cuda, count = states["cuda"], distributed.cuda_device_count()
    if cuda and len(cuda) == count:
        torch.cuda.set_rng_state_all(cuda)
    elif cuda:
        notes.append(
            f"the checkpoint holds CUDA RNG states of {len(cuda)} GPU(s), this process sees {count}: they were not "
            "restored, so seeded CUDA randomness (dropout, augmentation) differs from an uninterrupted run"
        )
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = states["random"]
    random.setstate((version, tuple(internal), gauss))
    return notes


def rank_rng_states() -> list[dict]:
    """Every rank's `rng_states()`, in rank order (a collective: every rank calls it). The ranks'
    generators part ways once they train on different shards (dropout, CUDA generators)."""
    return distributed.all_gather_object(rng_states())


def restore_rank_rng_states(saved: dict | list[dict]) -> list[str]:
    """Restore this rank's generators from a checkpoint's per-rank states (a single dict: a
    checkpoint of an older dpbench, rank 0's states). With another number of processes than
    wrote it, every rank takes rank 0's CPU states (seeded public randomness stays equal on all
    ranks) and no CUDA state; the note says so."""
    per_rank = saved if isinstance(saved, list) else [saved]
    if len(per_rank) == distributed.world_size():
        return restore_rng_states(per_rank[distributed.rank()])
    restore_rng_states({**per_rank[0], "cuda": []})
    return [
        f"the checkpoint was written by {len(per_rank)} process(es), this run has {distributed.world_size()}: every "
        "rank continued from rank 0's seeded CPU generators and no CUDA generator was restored, so seeded "
        "randomness (dropout, augmentation) differs from an uninterrupted run"
    ]


# --- signals -------------------------------------------------------------------------------------
def _watched_signals() -> list[signal.Signals]:
    """SIGTERM and SIGUSR1, plus submitit's preemption signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL
    says otherwise) when a handler is installed for it, i.e. when submitit runs this job."""
    watched = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])  # none on Windows
    submitit = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    if submitit is not None and submitit not in watched and callable(signal.getsignal(submitit)):
        watched.append(submitit)
    return watched


class StopSignals:
    """While active, SIGTERM/SIGUSR1 (and submitit's signal) only set `received`; the trainer
    finishes the step, checkpoints, then calls `chain()`, which hands the signal to the handler
    that was there before (submitit's requeue) and stops the run otherwise.

    A second signal of the same kind gets the previous handler at once (the default handler of
    SIGTERM ends the process: a way to stop without waiting for the step)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum)
        self._restore()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in _watched_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    def chain(self, step: int, path: Path | None) -> None:
        """After the checkpoint: let the previous handler act (submitit requeues and exits), then stop.
        Under torchrun a rank may stop on another rank's signal (the ranks agree to stop together)."""
        sig = self.received
        if sig is None:
            raise Preempted("a stop signal (on another rank)", step, path)
        previous = signal.getsignal(sig)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(sig, None)
        raise Preempted(sig.name, step, path)


# --- when to write -------------------------------------------------------------------------------
class Checkpointer:
    """Decides when the trainer writes a checkpoint and writes it (see the module docstring)."""

    def __init__(self, run_dir: Path, config: dict, every: int | None, signals: StopSignals | None = None,
                 sharded: bool = False, at_evaluations: bool = True):
        self.run_dir, self.config, self.every = Path(run_dir), config, every
        # after every evaluation (also whenever `every` is set: what is shown must be covered)
        self.at_evaluations = at_evaluations or every is not None
        self.signals = signals
        self.saved_step: int | None = None  # the step of the last checkpoint written (or resumed from)
        # Rank 0's state is the run's only where every rank holds the whole model; a sharded run
        # (train.sharding=fsdp) writes its model and optimizer state with torch.distributed.checkpoint.
        self.sharded = sharded

    @property
    def path(self) -> Path:
        return checkpoint_path(self.run_dir)

    def after_step(self, trainer, evaluated: bool) -> None:
        """Called after each step (and its evaluation): write when due, stop when signalled."""
        step = trainer.state.step
        stop = self.signals is not None and self.signals.received is not None
        if distributed.is_distributed():  # every rank stops at the same step (or none waits forever)
            stop = distributed.all_reduce_scalars(float(stop))[0] > 0
        final = step >= trainer.config.steps  # the run is complete: results.json follows, no stop
        # the final evaluation too: it is shown before results.json is written
        due = (evaluated and self.at_evaluations) or (not final and self.every is not None and step % self.every == 0)
        if (stop and not final) or due:
            self.save(trainer)
        if stop and not final:
            self.signals.chain(step, self.path)

    def save(self, trainer) -> Path:
        """Rank 0 writes (the replicas are identical; the seeded generators are gathered from every
        rank); the others wait until it is on disk, and all stop if it could not write. Sharded:
        every rank first writes its shards of the model and optimizer state (`save_sharded_state`)."""
        generators = rank_rng_states()
        algorithm = self._save_shards(trainer) if self.sharded else None
        error = None
        if distributed.is_main_process():
            try:
                write_checkpoint(self.run_dir, {"config": self.config, "step": trainer.state.step,
                                                "trainer": trainer.state_dict(generators, algorithm)})
                if algorithm is not None:  # the new checkpoint.pt is on disk: the older folders can go
                    prune_shards(self.run_dir, keep=algorithm["sharded"]["folder"])
            except Exception as failure:  # noqa: BLE001 - every rank stops with it (raise_together)
                error = failure
        distributed.raise_together(error, f"writing the checkpoint {self.path}")
        self.saved_step = trainer.state.step
        return self.path

    def interrupted_message(self, step: int, planned: int) -> str:
        """What Ctrl-C prints: where a rerun of the same command continues, or why it starts over."""
        if self.saved_step is not None:
            return (f"interrupted at step {step} of {planned}: {self.path} holds step {self.saved_step}; "
                    "rerun the same command to continue from it")
        if not self.at_evaluations:
            return (f"interrupted at step {step} of {planned} with no checkpoint (train.checkpoint=false): a rerun "
                    "starts from step 0; set train.checkpoint=true (or train.checkpoint_every=N) to resume")
        return (f"interrupted at step {step} of {planned} before the first checkpoint (written with the first "
                "evaluation, train.eval_every; train.checkpoint_every=N writes one every N steps): a rerun starts from step 0")

    def _save_shards(self, trainer) -> dict:
        """Every rank's shards into a fresh folder (its name from rank 0), then the checkpoint.pt
        entry that names it (a collective: every rank calls it)."""
        name = distributed.broadcast_object(f"step-{trainer.state.step:08d}-{secrets.token_hex(4)}")
        folder, error = shards_root(self.run_dir) / name, None
        try:
            save_sharded_state(trainer.algorithm, folder)
        except Exception as failure:  # noqa: BLE001 - every rank stops with it (raise_together)
            error = failure
        distributed.raise_together(error, f"writing the sharded checkpoint {folder}")
        return sharded_algorithm_entry(trainer.algorithm, name, trainer.config.log_private_stats)


def prune_shards(run_dir: Path, keep: str) -> None:
    """Delete every folder under checkpoint-shards/ but `keep` (older checkpoints, interrupted saves)."""
    for entry in shards_root(run_dir).iterdir():
        if entry.name == keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

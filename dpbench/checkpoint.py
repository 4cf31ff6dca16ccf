"""Checkpoints of a run in progress, and the preemption signals that trigger them.

`train.checkpoint_every=N` writes `checkpoint.pt` into the run folder every N steps and after
every evaluation; SIGTERM or SIGUSR1 (what SLURM sends before preemption or the time limit) lets
the current step finish, writes one and stops the process with exit status 75. Rerunning the same
command (same run folder, same config) continues from it; the file is deleted once results.json
is written.

What a checkpoint holds (torch.save of plain containers and tensors, read back with
`weights_only=True`): the trainer's step counter, privacy ledger, history, window loss and
throughput counters; the epoch in progress of a shuffled sampler; every rank's seeded RNG states
(torch, CUDA, numpy, random; restored per rank); and the algorithm's state, `algorithm_state()`
(trainable parameters and buffers, optimizer state, the attributes its class lists in
`checkpoint_attributes`: an algorithm only declares what to keep, this module saves it). Frozen parameters are not stored: they are rebuilt from the config
and seed, and a fingerprint of them is checked on load. The entropy-seeded privacy noise and
Poisson sampler are NOT restored: a resumed run draws fresh, independent randomness, which is what
the accountant assumes of every step anyway. A shuffled run's epoch in progress is restored so
that no example is in two batches of one epoch (the bound of `ShuffledLedger` counts epochs).

Why a checkpoint also follows every evaluation: an evaluation published (console, W&B) after the
last checkpoint depends on noisy releases that a resumed run would discard and redo, so its
epsilon would be missing from the resumed ledger.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from dpbench import distributed
from dpbench.errors import UserError
from dpbench.paths import atomic_write

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT = "dpbench-checkpoint"
FORMAT_VERSION = 1
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on request, rerun the same command to resume


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGUSR1 after writing its checkpoint (`path`; None: a sharded run,
    which cannot write one yet, stopped without)."""

    def __init__(self, signal_name: str, step: int, path: Path | None):
        where = (f"with a checkpoint in {path}; rerun the same command to resume" if path is not None else
                 "without a checkpoint (sharded checkpoints are not supported yet): a rerun starts over")
        super().__init__(f"{signal_name} received: stopped after step {step} {where}")
        self.step, self.path = step, path


# --- the file ---------------------------------------------------------------------------------
def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_FILE


def write_checkpoint(run_dir: Path, payload: dict) -> Path:
    """Atomically: a reader sees the previous checkpoint or the new one."""
    stamped = {"format": FORMAT, "version": FORMAT_VERSION, **payload}
    return atomic_write(checkpoint_path(run_dir), lambda handle: torch.save(stamped, handle), binary=True)


def read_checkpoint(run_dir: Path) -> dict | None:
    """The checkpoint in `run_dir` (None when there is none); a damaged one is a UserError."""
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
    return payload


def delete_checkpoint(run_dir: Path) -> None:
    checkpoint_path(run_dir).unlink(missing_ok=True)


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
        """After the checkpoint: let the previous handler act (submitit requeues and exits), then stop."""
        sig = self.received
        previous = signal.getsignal(sig)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(sig, None)
        raise Preempted(sig.name, step, path)


# --- when to write -------------------------------------------------------------------------------
class Checkpointer:
    """Decides when the trainer writes a checkpoint and writes it (see the module docstring)."""

    def __init__(self, run_dir: Path, config: dict, every: int | None, signals: StopSignals | None = None,
                 sharded: bool = False):
        self.run_dir, self.config, self.every = Path(run_dir), config, every
        self.signals = signals
        # Rank 0's state is the run's only where every rank holds the whole model; a sharded run
        # (train.sharding=fsdp) refuses checkpoint_every and stops on a signal without writing.
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
        if step >= trainer.config.steps:
            return  # the run is complete: results.json follows
        periodic = self.every is not None and (step % self.every == 0 or evaluated)
        if (stop or periodic) and not self.sharded:
            self.save(trainer)
        if stop:
            self.signals.chain(step, None if self.sharded else self.path)

    def save(self, trainer) -> Path:
        """Rank 0 writes (the replicas are identical; the seeded generators are gathered from every
        rank); the others wait until it is on disk, and all stop if it could not write."""
        generators = rank_rng_states()
        error = None
        if distributed.is_main_process():
            try:
                write_checkpoint(self.run_dir, {"config": self.config, "step": trainer.state.step,
                                                "trainer": trainer.state_dict(generators)})
            except Exception as failure:  # noqa: BLE001 - every rank stops with it (raise_together)
                error = failure
        distributed.raise_together(error, f"writing the checkpoint {self.path}")
        return self.path


# --- algorithm state: attributes of any shape as plain containers ---------------------------------
class CheckpointMismatch(ValueError):
    """The stored state does not fit the algorithm or model being restored."""


def pack(value, names: dict[int, str]):
    """A checkpointable copy of `value`: tensors on the CPU, generators as their state, dicts keyed
    by parameters keyed by parameter name (`names`: id -> name), containers recursively."""
    if isinstance(value, torch.Generator):
        return {"__kind__": "generator", "state": value.get_state()}
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        if value and all(isinstance(key, torch.nn.Parameter) for key in value):
            return {"__kind__": "by_parameter", "items": {names[id(k)]: pack(v, names) for k, v in value.items()}}
        return {key: pack(v, names) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pack(v, names) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


def unpack(saved, current, device: torch.device, parameters: dict[str, torch.nn.Parameter]):
    """The inverse of `pack`; a generator is restored into `current` in place (others share it)."""
    kind = saved.get("__kind__") if isinstance(saved, dict) else None
    if kind == "generator":
        generator = current if isinstance(current, torch.Generator) else torch.Generator()
        generator.set_state(saved["state"])
        return generator
    if kind == "by_parameter":
        missing = set(saved["items"]) - set(parameters)
        if missing:
            raise CheckpointMismatch(f"state of unknown parameters {sorted(missing)[:3]}")
        return {parameters[n]: unpack(v, None, parameters[n].device, parameters) for n, v in saved["items"].items()}
    if torch.is_tensor(saved):
        return saved.to(device)
    if isinstance(saved, dict):
        return {key: unpack(v, None, device, parameters) for key, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        return type(saved)(unpack(v, None, device, parameters) for v in saved)
    return saved


def frozen_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """(sum, norm) of every frozen parameter: they are rebuilt from config and seed, not stored."""
    return {
        name: [float(torch.sum(p.detach(), dtype=torch.float64)), float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64))]
        for name, p in model.named_parameters()
        if not p.requires_grad
    }


def check_frozen(model: torch.nn.Module, stored: dict[str, list[float]]) -> None:
    rebuilt = frozen_fingerprint(model)
    if set(rebuilt) != set(stored):
        raise CheckpointMismatch("the frozen parameters differ")
    for name, values in stored.items():
        if not np.allclose(rebuilt[name], values, rtol=1e-5, atol=1e-6):
            raise CheckpointMismatch(f"the rebuilt frozen parameter {name} differs from the checkpointed run's")


def _attribute(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def algorithm_state(algorithm, log_private_stats: bool = True) -> dict:
    """What continuing a run needs of an `Algorithm`: trainable parameters and buffers (frozen
    parameters are rebuilt from config and seed; their fingerprint is kept), a torch `optimizer`'s
    state and the attributes its class lists in `checkpoint_attributes` (None for its un-noised
    private statistics unless `log_private_stats`: resuming does not need them)."""
    withheld = set() if log_private_stats else algorithm.private_statistics()
    model = algorithm.model
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = getattr(algorithm, "optimizer", None)
    if "_frozen_fingerprint" not in vars(algorithm):  # frozen parameters never change: computed once
        algorithm._frozen_fingerprint = frozen_fingerprint(model)
    return {
        "parameters": {n: pack(p, names) for n, p in model.named_parameters() if p.requires_grad},
        "buffers": {n: pack(b, names) for n, b in model.named_buffers()},
        "frozen": algorithm._frozen_fingerprint,
        "optimizer": pack(optimizer.state_dict(), names) if isinstance(optimizer, torch.optim.Optimizer) else None,
        "attributes": {a: None if a in withheld else pack(_attribute(algorithm, a), names)
                       for a in algorithm.checkpointed_attributes()},
    }


def load_algorithm_state(algorithm, state: dict) -> None:
    """Restore `algorithm_state()` into a freshly built algorithm (CheckpointMismatch if it does not fit)."""
    model = algorithm.model
    parameters = dict(model.named_parameters())
    stored = {**state["parameters"], **state["buffers"]}
    current = {**{n: p for n, p in parameters.items() if p.requires_grad}, **dict(model.named_buffers())}
    if set(stored) != set(current) or any(stored[n].shape != current[n].shape for n in current):
        raise CheckpointMismatch("its trained parameters or buffers differ in name or shape")
    check_frozen(model, state["frozen"])
    with torch.no_grad():
        for name, tensor in current.items():
            tensor.copy_(stored[name])
    optimizer = getattr(algorithm, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state["optimizer"])
    needed = algorithm.checkpointed_attributes()
    if set(state["attributes"]) != set(needed):
        raise CheckpointMismatch(f"it holds {sorted(state['attributes'])}, {type(algorithm).__name__} needs {sorted(needed)}")
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    for dotted, saved in state["attributes"].items():
        if saved is None and dotted in algorithm.private_statistics():
            continue  # withheld (privacy.log_private_stats=false): the fresh value stays
        owner, _, name = dotted.rpartition(".")
        target = _attribute(algorithm, owner) if owner else algorithm
        setattr(target, name, unpack(saved, getattr(target, name), device, parameters))

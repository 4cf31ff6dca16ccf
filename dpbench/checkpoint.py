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
(trainable parameters and buffers, optimizer state, the attributes its class lists in
`checkpoint_attributes`: an algorithm only declares what to keep, this module saves it). Frozen parameters are not stored: they are rebuilt from the config
and seed, and a fingerprint of them is checked on load. The entropy-seeded privacy noise and
Poisson sampler are NOT restored: a resumed run draws fresh, independent randomness, which is what
the accountant assumes of every step anyway. A shuffled run's epoch in progress is restored so
that no example is in two batches of one epoch (the bound of `ShuffledLedger` counts epochs).

Why a checkpoint also follows every evaluation: an evaluation published (console, W&B) after the
last checkpoint depends on noisy releases that a resumed run would discard and redo, so its
epsilon would be missing from the resumed ledger.

Sharded runs (`train.sharding=fsdp`, dpbench/sharding.py) hold 1/K of the model and optimizer
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

from dpbench import distributed
from dpbench.errors import UserError
from dpbench.paths import atomic_write

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


# --- algorithm state: attributes of any shape as plain containers ---------------------------------
class CheckpointMismatch(ValueError):
    """The stored state does not fit the algorithm or model being restored."""


def pack(value, names: dict[int, str]):
    """A checkpointable copy of `value`: tensors on the CPU, generators as their state, dicts keyed
    by parameters keyed by parameter name (`names`: id -> name), containers recursively."""
    if isinstance(value, torch.Generator):
        return {"__kind__": "generator", "state": value.get_state()}
    if hasattr(value, "to_local"):  # a DTensor (train.sharding=fsdp): only its rank's shard is here
        raise TypeError("cannot checkpoint a sharded tensor (DTensor) as an attribute: keep it in the optimizer")
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


def _attributes_state(algorithm, log_private_stats: bool, names: dict[int, str]) -> dict:
    withheld = set() if log_private_stats else algorithm.private_statistics()
    return {a: None if a in withheld else pack(_attribute(algorithm, a), names) for a in algorithm.checkpointed_attributes()}


def _load_attributes(algorithm, attributes: dict, device: torch.device, parameters: dict) -> None:
    needed = algorithm.checkpointed_attributes()
    if set(attributes) != set(needed):
        raise CheckpointMismatch(f"it holds {sorted(attributes)}, {type(algorithm).__name__} needs {sorted(needed)}")
    for dotted, saved in attributes.items():
        if saved is None and dotted in algorithm.private_statistics():
            continue  # withheld (privacy.log_private_stats=false): the fresh value stays
        owner, _, name = dotted.rpartition(".")
        target = _attribute(algorithm, owner) if owner else algorithm
        setattr(target, name, unpack(saved, getattr(target, name), device, parameters))


def algorithm_state(algorithm, log_private_stats: bool = True) -> dict:
    """What continuing a run needs of an `Algorithm`: trainable parameters and buffers (frozen
    parameters are rebuilt from config and seed; their fingerprint is kept), a torch `optimizer`'s
    state and the attributes its class lists in `checkpoint_attributes` (None for its un-noised
    private statistics unless `log_private_stats`: resuming does not need them)."""
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
        "attributes": _attributes_state(algorithm, log_private_stats, names),
    }


def load_algorithm_state(algorithm, state: dict) -> None:
    """Restore `algorithm_state()` (or a sharded run's `sharded_algorithm_entry`) into a freshly
    built algorithm (CheckpointMismatch if it does not fit)."""
    sharded = getattr(algorithm, "sharded", False)
    if isinstance(state.get("sharded"), dict) or sharded:
        if not (isinstance(state.get("sharded"), dict) and sharded):
            raise CheckpointMismatch("one of the checkpoint and this run is sharded (train.sharding=fsdp), the other not")
        load_sharded_state(algorithm, state)
        return
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
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    _load_attributes(algorithm, state["attributes"], device, parameters)


# --- sharded state (train.sharding=fsdp): torch.distributed.checkpoint ------------------------------
def _dcp_state(algorithm) -> dict:
    """The model's and optimizer's state dicts as DCP reads and writes them: DTensors holding this
    rank's shards, keyed by parameter name (`get_state_dict`; a collective)."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    optimizer = getattr(algorithm, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        model_state, optimizer_state = dcp_state.get_state_dict(algorithm.model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}
    return {"model": dcp_state.get_model_state_dict(algorithm.model)}


def save_sharded_state(algorithm, folder: Path) -> None:
    """Every rank writes its shards of the model and optimizer state into `folder` (`dcp.save`, a
    collective; rank 0 adds DCP's .metadata once all have written)."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(_dcp_state(algorithm), checkpoint_id=str(folder))


def sharded_algorithm_entry(algorithm, folder_name: str, log_private_stats: bool = True) -> dict:
    """checkpoint.pt's algorithm state of a sharded run: the DCP folder's name (relative to the
    run folder's checkpoint-shards/, so a moved run folder still resumes), the world size that
    wrote it and every rank's `checkpoint_attributes` (a collective: every rank calls it)."""
    names = {id(p): n for n, p in algorithm.model.named_parameters()}
    attributes = distributed.all_gather_object(_attributes_state(algorithm, log_private_stats, names))
    return {"sharded": {"folder": folder_name, "world_size": distributed.world_size()}, "attributes": attributes}


def load_sharded_state(algorithm, state: dict) -> None:
    """Restore a sharded checkpoint into a freshly built sharded algorithm: each rank reads its
    rows of every parameter and optimizer state from the DCP folder (`dcp.load`, resharding when
    the checkpoint was written by another number of ranks), then this rank's attributes (rank 0's
    under another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state

    path = state["sharded"].get("path")
    if path is None:
        raise CheckpointMismatch("it does not say where its sharded state is (read it with read_checkpoint)")
    target = _dcp_state(algorithm)
    dcp.load(target, checkpoint_id=path)
    if "optimizer" in target:
        dcp_state.set_state_dict(algorithm.model, algorithm.optimizer, model_state_dict=target["model"],
                                 optim_state_dict=target["optimizer"])
    else:
        dcp_state.set_model_state_dict(algorithm.model, target["model"])
    per_rank = state["attributes"]
    mine = per_rank[distributed.rank()] if len(per_rank) == distributed.world_size() else per_rank[0]
    parameters = dict(algorithm.model.named_parameters())
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    _load_attributes(algorithm, mine, device, parameters)


def prune_shards(run_dir: Path, keep: str) -> None:
    """Delete every folder under checkpoint-shards/ but `keep` (older checkpoints, interrupted saves)."""
    for entry in shards_root(run_dir).iterdir():
        if entry.name == keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

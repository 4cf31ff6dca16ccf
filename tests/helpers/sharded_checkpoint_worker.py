"""One rank of the sharded checkpoint tests (tests/run/test_sharded_checkpoint.py), started by
torch.multiprocessing: whole `run_job`s of `train.sharding=fsdp` (DP-Adam, book-keeping, micro
ViT) in the same run folders on every rank.

`run_two` (2 ranks): an uninterrupted run; a run killed when step KILL_AT starts (its last
checkpoint is the one after step 4), which is copied for `run_three` and then resumed; a run
whose rank 0 gets SIGUSR1 during step SIGNAL_AT, then resumed. `run_three` (3 ranks) resumes the
copy written by 2. Each rank snapshots the model and Adam state (whole tensors and its own
shards) when a checkpoint is written and right after one is loaded, and saves everything to
<out>/rank<r>.pt.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import torch

from dpbench.runtime import checkpoint, distributed
from dpbench.algorithms import Algorithm
from dpbench.runtime.trainer import Trainer
from helpers.config import FIXED_SIGMA, OFFLINE, compose
from helpers.ranks import become_rank

STEPS, KILL_AT, SIGNAL_AT = 6, 5, 3
OVERRIDES = [*OFFLINE, *FIXED_SIGMA, "algo=dpadam", "algo.per_sample=bk", "dataset=synthetic", "model=vit",
             "train.sharding=fsdp", f"train.steps={STEPS}", "train.eval_every=3", "train.batch_size=16",
             "train.physical_batch_size=8"]
EVERY = ["train.checkpoint_every=2"]


class Killed(Exception):
    pass


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "to_local") else tensor).detach().clone()


def own(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def snapshot(algorithm) -> dict:
    """The parameters and Adam's state by parameter name: whole (gathered, a collective) and this
    rank's shards."""
    names = {id(p): n for n, p in algorithm.model.named_parameters()}
    params = dict(algorithm.model.named_parameters())
    moments = {names[id(p)]: state for p, state in algorithm.optimizer.state.items()}
    return {
        "params": {n: whole(p) for n, p in params.items()},
        "own_params": {n: own(p) for n, p in params.items()},
        "optimizer": {n: {k: whole(v) for k, v in s.items()} for n, s in sorted(moments.items())},
        "own_optimizer": {n: {k: own(v) for k, v in s.items()} for n, s in sorted(moments.items())},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in algorithm.optimizer.param_groups],
    }


def watch(patch: list, saved: dict, loaded: list) -> None:
    """Snapshot after every checkpoint write (by step) and after every load."""
    original_save, original_load = checkpoint.Checkpointer.save, Trainer.load_state_dict

    def save(self, trainer):
        path = original_save(self, trainer)
        saved[trainer.state.step] = snapshot(trainer.algorithm)
        saved[trainer.state.step]["folders"] = sorted(p.name for p in checkpoint.shards_root(self.run_dir).iterdir())
        return path

    def load(self, state):
        original_load(self, state)
        loaded.append({"step": self.state.step, **snapshot(self.algorithm)})

    checkpoint.Checkpointer.save, Trainer.load_state_dict = save, load
    patch.append(lambda: (setattr(checkpoint.Checkpointer, "save", original_save),
                          setattr(Trainer, "load_state_dict", original_load)))


def summary(results) -> dict:
    return {"steps": results.privacy.steps, "ledger": results.privacy.ledger, "epsilon": results.privacy.epsilon,
            "resumed_from_step": results.resumed_from_step, "history": [h.step for h in results.history],
            "notes": results.notes}


def _setup(rank: int, world: int, port: int) -> None:
    become_rank(rank, world, port)


def run_killed_at(cfg, folder: Path, step: int, results: dict) -> None:
    """`run_job` in `folder`, killed (Killed raised) when step `step` starts: its latest checkpoint
    is the one before; results["killed"] records that it was killed."""
    from dpbench.run import run_job

    original_step = Algorithm.train_step

    def train_step(self, batches, step_index):
        if step_index == step:
            raise Killed
        return original_step(self, batches, step_index)

    Algorithm.train_step = train_step
    results["saved"].clear()
    try:
        run_job(cfg, folder, show_progress=False)
    except Killed:
        results["killed"] = "Killed"
    finally:
        Algorithm.train_step = original_step


def run_two(rank: int, world: int, port: int, out: str) -> None:
    from dpbench.run import run_job

    _setup(rank, world, port)
    out = Path(out)
    results: dict = {"saved": {}, "loaded": []}
    restore: list = []
    watch(restore, results["saved"], results["loaded"])
    cfg = compose(OVERRIDES + EVERY)
    results["whole"] = summary(run_job(cfg, out / "whole", show_progress=False))
    results["whole_left"] = sorted(p.name for p in (out / "whole").iterdir())

    # killed when step KILL_AT starts: the checkpoint of step 4 is the latest
    killed = out / "killed"
    run_killed_at(cfg, killed, KILL_AT, results)
    results["after_kill"] = {"files": sorted(p.name for p in killed.iterdir()),
                             "folders": sorted(p.name for p in checkpoint.shards_root(killed).iterdir()),
                             "stored_step": checkpoint.read_checkpoint(killed)["step"]}
    results["saved_at_kill"] = dict(results["saved"])
    distributed.barrier()
    if rank == 0:  # for the 3-rank resume
        shutil.copytree(killed, out / "for_three")
    distributed.barrier()
    results["loaded"].clear()
    results["resumed"] = summary(run_job(cfg, killed, show_progress=False))
    results["resumed_loaded"] = list(results["loaded"])
    results["resumed_left"] = sorted(p.name for p in killed.iterdir())

    # SIGUSR1 on rank 0 during step SIGNAL_AT (no checkpoint_every): checkpoint, stop on every rank
    signalled = out / "signalled"
    plain = compose(OVERRIDES)
    original_record = Trainer._record

    def record(self, result):
        original_record(self, result)
        if self.state.step == SIGNAL_AT and rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)

    Trainer._record = record
    results["saved"].clear()
    try:
        run_job(plain, signalled, show_progress=False)
    except checkpoint.Preempted as stopped:
        results["preempted"] = {"step": stopped.step, "message": str(stopped)}
    finally:
        Trainer._record = original_record
    results["signal_saved"] = dict(results["saved"])
    results["loaded"].clear()
    results["signal_resumed"] = summary(run_job(plain, signalled, show_progress=False))
    results["signal_loaded"] = list(results["loaded"])
    for undo in restore:
        undo()
    torch.save(results, out / f"rank{rank}.pt")
    distributed.shutdown()


def run_three(rank: int, world: int, port: int, out: str) -> None:
    """Resume the checkpoint `run_two` wrote (copied into <out>/run) on `world` ranks, writing a
    checkpoint after every step (train.checkpoint_every is not part of the run's identity)."""
    from dpbench.run import run_job

    _setup(rank, world, port)
    out = Path(out)
    results: dict = {"saved": {}, "loaded": []}
    restore: list = []
    watch(restore, results["saved"], results["loaded"])
    results["resumed"] = summary(run_job(compose(OVERRIDES + ["train.checkpoint_every=1"]), out / "run", show_progress=False))
    for undo in restore:
        undo()
    torch.save(results, out / f"rank{rank}.pt")
    distributed.shutdown()


# --- noise off: a resumed run ends where the uninterrupted one does --------------------------------
NOISELESS_AT = 3  # the killed run's checkpoint: after step 3 of STEPS
NOISELESS = OVERRIDES + ["privacy.sampling=shuffle", f"train.checkpoint_every={NOISELESS_AT}"]
SAMPLER_SEED = 1234  # test-only: the shuffled order (a private run's is entropy-seeded)


def _noise_off_and_a_fixed_order() -> None:
    """The test-only seams (as in tests/run/test_checkpoint.py and tests/tools/audit/test_audit.py):
    every noise draw is exact zeros (not a small sigma), and the shuffled sampler's permutation
    comes from a fixed seed. STEPS batches of 16 lie in the first epoch (15 of the 256 synthetic
    examples'), whose order the checkpoint stores; rank 0 draws it and broadcasts the indices."""
    from dpbench.privacy import sampling
    from dpbench.privacy.noise import GaussianNoise

    GaussianNoise.sample = lambda self, shape, std, dtype=torch.float32: torch.zeros(shape, device=self.device, dtype=dtype)
    sampling.entropy_seed = lambda: SAMPLER_SEED


def _watch_fit(finals: list) -> None:
    """Snapshot the model and Adam state when `Trainer.fit` returns (a collective: every rank)."""
    original_fit = Trainer.fit

    def fit(self):
        from torch.distributed.fsdp import FSDPModule

        state = original_fit(self)
        # the final evaluation's forward (no backward) leaves the root's parameters unsharded
        # (FSDP2 does not reshard the root after a forward): put the shards back to read them
        for module in self.algorithm.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        finals.append({"step": self.state.step, **snapshot(self.algorithm)})
        return state

    Trainer.fit = fit


def _noiseless_rank(rank: int, world: int, port: int) -> dict:
    """A spawned rank of the noiseless runs, and what it will record (checkpoints saved and
    loaded, the parameters at the end of each fit)."""
    _setup(rank, world, port)
    _noise_off_and_a_fixed_order()
    results: dict = {"saved": {}, "loaded": [], "finals": []}
    watch([], results["saved"], results["loaded"])
    _watch_fit(results["finals"])
    return results


def run_noiseless(rank: int, world: int, port: int, out: str) -> None:
    """The first spawn: STEPS uninterrupted steps, then a run killed when step NOISELESS_AT + 1
    starts (its checkpoint is the one after step NOISELESS_AT). `resume_noiseless` (fresh
    processes) finishes it."""
    from dpbench.run import run_job

    results, out = _noiseless_rank(rank, world, port), Path(out)
    cfg = compose(NOISELESS)
    results["whole"] = summary(run_job(cfg, out / "whole", show_progress=False))
    run_killed_at(cfg, out / "killed", NOISELESS_AT, results)
    results["stored_step"] = checkpoint.read_checkpoint(out / "killed")["step"]
    torch.save(results, out / f"rank{rank}.pt")
    distributed.shutdown()


def resume_noiseless(rank: int, world: int, port: int, out: str) -> None:
    """The second spawn (fresh processes): resume <out>/killed (a copy of the first spawn's) to
    step STEPS."""
    from dpbench.run import run_job

    results, out = _noiseless_rank(rank, world, port), Path(out)
    results["resumed"] = summary(run_job(compose(NOISELESS), out / "killed", show_progress=False))
    torch.save(results, out / f"rank{rank}.pt")
    distributed.shutdown()

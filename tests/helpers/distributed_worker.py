"""One rank of the 2-process gloo test (tests/run/test_distributed.py), started by torch.multiprocessing.

Rank 0 first trains every algorithm in one process (the reference: no process group yet), then
both ranks join the group and train the same logical batches, each on its shard indices[r::K].
Everything a rank measured is saved to <out>/rank<r>.pt for the test to compare.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpbench.runtime import distributed
from dpbench.algorithms import ALGORITHMS
from dpbench.algorithms.base import ReleasePart
from dpbench.runtime.checkpoint import rank_rng_states, restore_rank_rng_states
from dpbench.errors import DivergedError, UserError
from dpbench.privacy.sampling import PoissonBatches, ShardedBatches
from helpers.algorithms import build_algorithm
from helpers.ranks import become_rank

# Algorithms compared with the one-process step (noise off). Overrides make every part do work on
# the tiny model: DP-GRAPE projects both Linears, DPDR decomposes from step 1.
ALGORITHMS_COMPARED = {
    "dpsgd": [],
    "dpadam": [],
    "grape": ["algo.rank=4", "algo.projected_modules=['1','3']", "algo.update_interval=2"],
    "dpdr": ["algo.decomposition_steps=3"],
    "dpzero": [],
}
# Logical batches (indices into the synthetic train set) of the compared steps: sizes 20, 17, 23.
LOGICAL_BATCHES = [list(range(0, 20)), list(range(30, 47)), list(range(60, 83))]
PHYSICAL = 3  # physical chunk size on every rank (and in the reference)
NOISE_COORDINATES = 40_000


def chunks(indices: list[int], task) -> list:
    return [task.batch(indices[i : i + PHYSICAL]) for i in range(0, len(indices), PHYSICAL)] or [task.batch([])]


def train(algo: str, rank: int, world: int, sigma: float = 0.0) -> dict:
    algorithm, task, _ = build_algorithm(algo, *ALGORITHMS_COMPARED[algo], sigma=sigma, clip=0.5, batch=20.0)
    steps = []
    for step, indices in enumerate(LOGICAL_BATCHES):
        result = algorithm.train_step(chunks(indices[rank::world], task), step)
        steps.append((result.loss, result.batch_size, [m.noise_multiplier for m in result.mechanisms]))
    return {"params": [p.detach().clone() for p in algorithm.model.parameters()], "steps": steps}


def noise_of_one_release(rank: int) -> dict:
    """A release of the constant (rank + 1) per coordinate at noise std sigma C = 1.5 * 2."""
    algorithm, _, _ = build_algorithm("dpsgd", sigma=1.5, clip=2.0)
    values = [torch.full((NOISE_COORDINATES,), float(rank + 1))]
    (noisy,) = algorithm.gaussian_release("gradient", ReleasePart(values, 2.0, 3.0))
    return {"noisy": noisy[0], "mechanisms": [m.noise_multiplier for m in algorithm.step_mechanisms]}


def sampler_shards(rank: int, world: int) -> list[list[int]]:
    sampler = iter(ShardedBatches(PoissonBatches(200, 0.2), rank, world))
    return [next(sampler) for _ in range(5)]


def refusals() -> dict:
    out = {}
    for name in ("adam", "mezo", "dcdpsgd"):
        try:
            distributed.require_data_parallel(ALGORITHMS.get(name), name)
            out[name] = None
        except UserError as error:
            out[name] = str(error)
    return out


def replica_check(rank: int) -> str | None:
    torch.manual_seed(rank)  # deliberately different initialisation per rank
    try:
        distributed.check_replicas(torch.nn.Linear(3, 2))
    except RuntimeError as error:
        return str(error)
    return None


def caught(action) -> str | None:
    """`type: message` of what `action()` raised (None: nothing)."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(error).__name__}: {error}"
    return None


def agreements(rank: int) -> dict:
    """Stops and checks that every rank takes together (dpbench.runtime.distributed.raise_together)."""
    plan = {"noise_multiplier": 1.5, "clip_norm": 1.0, "algo": {"name": "dpsgd"}}
    return {
        "same_plan": caught(lambda: distributed.check_same_as_rank_zero("privacy plan", plan)),
        "other_plan": caught(lambda: distributed.check_same_as_rank_zero(
            "privacy plan", {**plan, "noise_multiplier": 1.5 + rank})),
        "nothing_failed": caught(lambda: distributed.raise_together(None, "in step 3")),
        "diverged_on_1": caught(lambda: distributed.raise_together(
            DivergedError("training loss became nan") if rank == 1 else None, "in step 3")),
        "crashed_on_0": caught(lambda: distributed.raise_together(
            ValueError("disk full") if rank == 0 else None, "in step 4")),
    }


def generators(rank: int) -> dict:
    """Per-rank RNG states: each rank gets its own back, and another world size gets rank 0's."""
    torch.manual_seed(100 + rank)  # the ranks' generators part ways (dropout on different shards)
    states = rank_rng_states()
    expected = torch.rand(3)
    torch.manual_seed(999)
    notes = restore_rank_rng_states(states)
    own = torch.rand(3)
    other_world = restore_rank_rng_states(states[:1])  # a checkpoint written by one process
    return {"expected": expected, "restored": own, "notes": notes, "other_world_notes": other_world,
            "other_world_draw": torch.rand(3)}


def run(rank: int, world: int, port: int, out: str) -> None:
    become_rank(rank, world, port)
    results: dict = {}
    if rank == 0:  # one process, before any process group exists
        results["reference"] = {algo: train(algo, 0, 1) for algo in ALGORITHMS_COMPARED}
    distributed.init_from_environment()
    assert distributed.is_distributed() and distributed.backend() == "gloo"
    results["sharded"] = {algo: train(algo, rank, world) for algo in ALGORITHMS_COMPARED}
    results["noisy_dpsgd"] = train("dpsgd", rank, world, sigma=1.0)  # noise on: replicas must stay equal
    results["noise"] = noise_of_one_release(rank)
    results["shards"] = sampler_shards(rank, world)
    results["refusals"] = refusals()
    results["replica_check"] = replica_check(rank)
    results["agreements"] = agreements(rank)
    results["generators"] = generators(rank)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()
    results["shut_down"] = not torch.distributed.is_initialized()
    torch.save(results, Path(out) / f"rank{rank}.pt")

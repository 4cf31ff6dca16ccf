"""One rank of the 2-process test of the replicated releases under FSDP2 (DP-GRAPE and DPZero,
tests/run/test_sharded_replicated.py), started by torch.multiprocessing.

Rank 0 first trains each algorithm in one process (the reference, before any process group),
then both ranks shard the same model (`sharding.shard_model`: the micro ViT; for the `_opt` runs
the tiny OPT with its LM head tied to the input embedding, left to the root, on the offline boolq
fixture of tests/helpers/sharding_worker.py) and train the same logical batches, each on its
indices[r::K] in physical chunks (the batches are fixed here, as in
tests/helpers/sharding_worker.py, per model). Both runs draw their privacy noise from a generator seeded
with the same test-only seed: a replicated release is drawn by rank 0 alone, in the order one
process draws, so the two runs add the same noise and must end at the same parameters.
Everything a rank measured is saved to <out>/rank<r>.pt.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpbench.runtime import distributed, sharding
from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.privacy.noise import GaussianNoise
from dpbench.tasks import build_task
from helpers.config import OFFLINE, compose
from helpers.ranks import become_rank
from helpers.sharding_worker import BATCH, CLIP, MODELS, TEXT, WORLD, chunks, whole

SIGMA = 2.0
NOISE_SEED = 1234  # test-only: the same noise on both sides (a run's noise is entropy-seeded)
# algorithm -> (its config overrides, learning rate, clip norm). DP-GRAPE: rank 8 (qkv and fc1
# project on the right, proj and fc2 on the left), new projectors every 2 steps; Adam's eps above
# rounding (see sharding_worker.build). DPZero: C = 100, above every |s_i| here, so that
# the released sum is the finite differences themselves, not only their signs times C (the
# sums are up to 73 in magnitude here).
GRAPE = ["algo=grape", "algo.rank=8", "algo.update_interval=2", "algo.eps=1e-4"]
RUNS = {
    "grape": ([*GRAPE, "algo.per_sample=bk"], 1e-2, CLIP),
    "grape_ghost": ([*GRAPE, "algo.per_sample=ghost"], 1e-2, CLIP),
    "dpzero": (["algo=dpzero", "algo.mode=full"], 1e-5, 100.0),  # every weight: LoRA mode does not shard
    # the tiny OPT (tied head): DP-GRAPE bk projects the decoder layers' Linears; the tied
    # embedding/head, the position embedding, biases and norms are released full-size
    "grape_opt": ([*GRAPE, "algo.per_sample=bk"], 1e-2, CLIP),
    "dpzero_opt": (["algo=dpzero", "algo.mode=full"], 1e-5, 100.0),
}


def model_of(run_name: str) -> str:
    return "opt" if run_name.endswith("_opt") else "vit"


def logical_batches(run_name: str) -> list[list[int]]:
    """The logical batches of the run's 5 steps (sharding_worker's, per model)."""
    return MODELS[model_of(run_name)][1]


def build(run_name: str, sharded: bool):
    overrides, lr, clip = RUNS[run_name]
    name = model_of(run_name)
    text = [f"dataset.path={TEXT['path'] / 'boolq'}"] if name == "opt" else []
    cfg = compose([*OFFLINE, *MODELS[name][0], *text, *overrides])
    task = build_task(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    model.train()
    if sharded:
        sharding.shard_model(model, sharding.block_patterns(name), torch.device("cpu"))
    noise = GaussianNoise("cpu")
    noise.generator.manual_seed(NOISE_SEED)
    privacy = PrivacySetup(noise_multiplier=SIGMA, clip_norm=clip, expected_batch_size=BATCH,
                           sample_rate=BATCH / task.train_size, noise=noise)
    return algorithm_class(str(cfg.algo.name))(model, task, cfg.algo, lr, privacy), task, cfg


def train(run_name: str, rank: int, world: int) -> dict:
    algorithm, task, cfg = build(run_name, world > 1)
    releases = []  # (the global sums the noise was added to, the noisy values) per release
    algorithm.release_observer = lambda name, parts, noisy, mechanism: releases.append(
        ([v.detach().clone() for v in parts[0].values], [v.detach().clone() for v in noisy[0]]))
    steps = []
    for step, indices in enumerate(logical_batches(run_name)):
        # the reference runs the ranks' physical chunks one after the other: the same per-example
        # arithmetic, so that what differs is only the order of the sums
        physical = chunks(indices[rank::world], task) if world > 1 else \
            [c for r in range(WORLD) for c in chunks(indices[r::WORLD], task)]
        result = algorithm.train_step(physical, step)
        planned = type(algorithm).planned_mechanisms(cfg.algo, SIGMA, algorithm.privacy.sample_rate, step,
                                                     algorithm.privacy.clip_norm)
        steps.append((result.loss, result.batch_size, [(m.noise_multiplier, m.sample_rate) for m in result.mechanisms],
                      [(m.noise_multiplier, m.sample_rate) for m in planned]))
    sharded_params = [p for p in algorithm.model.parameters() if hasattr(p, "to_local")]
    heads = [module for name, module in algorithm.model.named_modules() if name.endswith("lm_head")]
    return {
        "steps": steps, "releases": releases, "clip": algorithm.privacy.clip_norm,
        "params": {name: whole(p).detach().clone() for name, p in algorithm.model.named_parameters()},
        "sharded": len(sharded_params),
        "tied": bool(heads) and all(h.weight is algorithm.model.get_input_embeddings().weight for h in heads),
        "seed": algorithm.projection_seed if run_name.startswith("grape") else next_seed(algorithm.seed_generator),
        "moments": {name: [t.clone() for t in algorithm.optimizer.state[p]] for name, p in algorithm.model.named_parameters()
                    if hasattr(algorithm, "optimizer") and p in algorithm.optimizer.state},
    }


def next_seed(generator: torch.Generator) -> int:
    """The next direction seed DPZero would draw (from a copy of its generator)."""
    copy = torch.Generator()
    copy.set_state(generator.get_state())
    return int(torch.randint(0, 2**62, (), generator=copy).item())


def run(rank: int, world: int, port: int, out: str) -> None:
    become_rank(rank, world, port)
    results: dict = {}
    from helpers.text_data import write_dataset

    TEXT["path"] = write_dataset(Path(out) / f"text{rank}", "boolq", n_train=32, n_test=8).parent
    if rank == 0:  # one process, before any process group exists
        for name in RUNS:
            results[f"{name}_reference"] = train(name, 0, 1)
    distributed.init_from_environment()
    for name in RUNS:
        results[name] = train(name, rank, world)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()

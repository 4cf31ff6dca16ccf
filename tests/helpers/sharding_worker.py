"""One rank of the 2-process FSDP2 test (tests/run/test_sharding.py), started by torch.multiprocessing.

Rank 0 first trains DP-Adam (book-keeping) on a micro ViT in one process (the reference, before
any process group), then both ranks shard the same model with `train.sharding=fsdp`'s
`shard_model` and train the same logical batches, each on its indices[r::K] in physical chunks.
The logical batches are fixed here: the test-only stand-in for the trainer's entropy-seeded
Poisson sampler (as in tests/helpers/distributed_worker.py), so that the two runs see the same
examples. Everything a rank measured is saved to <out>/rank<r>.pt for the test to compare.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from dpbench.runtime import distributed, sharding
from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.privacy.noise import GaussianNoise
from dpbench.tasks import build_task
from helpers.config import OFFLINE, compose
from helpers.ranks import become_rank

# Logical batches of the 5 compared steps (sizes 13, 7, 19, 1, 11): the ranks' shards and chunk
# counts differ (13 -> 7 + 6 examples, 3 + 2 chunks of 3), and in step 4 rank 1 has no example.
LOGICAL_BATCHES = [list(range(13)), list(range(20, 27)), list(range(30, 49)), [50], list(range(60, 71))]
PHYSICAL = 3
WORLD = 2
CLIP, BATCH, LR = 0.5, 12.0, 1e-2
NOISY_SIGMA = 2.0


def chunks(indices: list[int], task) -> list:
    return [task.batch(indices[i : i + PHYSICAL]) for i in range(0, len(indices), PHYSICAL)] or [task.batch([])]


MODELS = {  # model -> (its config overrides, the logical batches of its steps)
    "vit": (["dataset=synthetic", "model=vit"], LOGICAL_BATCHES),
    "vit_ghost": (["dataset=synthetic", "model=vit", "algo.per_sample=ghost"], LOGICAL_BATCHES),  # two backwards
    # tied input embedding and LM head (left to the root); 24 training examples
    "opt": (["model=opt", "model.size=tiny", "dataset=boolq", "dataset.num_train=24", "dataset.num_dev=4",
             "dataset.num_test=4"], [list(range(7)), list(range(8, 13)), [14], list(range(15, 24)), list(range(2, 11))]),
}
TEXT = {}  # the folder of this rank's offline text data (opt)


def build(sharded: bool, sigma: float = 0.0, model_name: str = "vit"):
    # Adam's eps well above rounding: a coordinate whose gradient is 0 in exact arithmetic (an
    # attention key's bias) gets rounding noise, which eps = 1e-8 would blow up to steps of lr
    # whose sign depends on the order of the sums (chunks differ between the runs).
    text = [f"dataset.path={TEXT['path'] / 'boolq'}"] if model_name == "opt" else []
    cfg = compose([*OFFLINE, "algo=dpadam", "algo.per_sample=bk", "algo.eps=1e-4", *MODELS[model_name][0], *text])
    task = build_task(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    model.train()
    patterns = sharding.block_patterns(str(cfg.model.name))
    wrapped = sharding.shard_model(model, patterns, torch.device("cpu")) if sharded else []
    privacy = PrivacySetup(noise_multiplier=sigma, clip_norm=CLIP, expected_batch_size=BATCH,
                           sample_rate=BATCH / task.train_size, noise=GaussianNoise("cpu"))
    algorithm = algorithm_class("dpadam")(model, task, cfg.algo, LR, privacy)
    return algorithm, task, wrapped


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(rank: int, world: int, sigma: float = 0.0, teacher: bool = False, model_name: str = "vit") -> dict:
    """Five steps. `teacher`: before each step, rank 0 also forms the one-process clipped sum of
    the same examples at the sharded run's current parameters (an unsharded copy, no collective),
    so that each step's release is compared with one process's at the same point."""
    algorithm, task, wrapped = build(world > 1, sigma, model_name)
    reference = build(False, 0.0, model_name)[0] if teacher and rank == 0 else None
    taught = []
    releases: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (sums released, noisy) per step
    algorithm.release_observer = lambda name, parts, noisy, mechanism: releases.append(
        ([v.detach().clone() for v in parts[0].values], [v.detach().clone() for v in noisy[0]]))
    steps = []
    accumulated = AccumulatorMeter(algorithm) if world > 1 else []
    for step, indices in enumerate(MODELS[model_name][1]):
        # the reference (one process) runs the ranks' physical chunks one after the other: the same
        # per-example arithmetic, so that what differs is only the order of the sums
        physical = chunks(indices[rank::world], task) if world > 1 else \
            [c for r in range(WORLD) for c in chunks(indices[r::WORLD], task)]
        if teacher:
            current = {name: whole(p).detach().clone() for name, p in algorithm.model.named_parameters()}
            if reference is not None:
                reference.model.load_state_dict(current, strict=False)
                everything = [c for r in range(world) for c in chunks(indices[r::world], task)]
                taught.append([t.clone() for t in reference.clip_and_accumulate(everything)[0]])
        result = algorithm.train_step(physical, step)
        if accumulated:  # reduce-scatters after clip_and_accumulate returned: the release's
            accumulated[-1]["in_release"] = len(accumulated.calls)
        steps.append((result.loss, result.batch_size, [m.noise_multiplier for m in result.mechanisms]))
    if world > 1:  # the observer saw whole tensors, gathered from the ranks' rows by the release
        accumulated.restore()
    local_noise = None
    if sigma and world > 1:  # this rank's own shard of the last release's noise (before gathering)
        local_noise = torch.cat([(n - s).flatten() for s, n in zip(*last_local_release(algorithm, task, rank, world))])
    if world > 1:  # FSDP2 keeps the tie: one parameter for the embedding and the head
        tied = [name for name, module in algorithm.model.named_modules() if name.endswith("lm_head")]
        wrapped = wrapped + [f"tied:{name}" for name in tied
                             if algorithm.model.get_submodule(name).weight is algorithm.model.get_input_embeddings().weight]
    params = {name: whole(p).detach().clone() for name, p in algorithm.model.named_parameters()}
    return {
        "steps": steps, "releases": releases, "params": params, "taught": taught, "wrapped": wrapped, "local_noise": local_noise,
        "parameter_bytes": sharding.local_bytes(algorithm.model.parameters()),
        "optimizer_state_bytes": algorithm.optimizer_state_bytes(),
        "peak_bytes": algorithm.per_sample_grad_bytes,
        "accumulated": list(accumulated),
        "full_shapes": [tuple(p.shape) for p in algorithm.params],
        "local_shapes": [tuple(sharding.local(p).shape) for p in algorithm.params],
    }


class AccumulatorMeter(list):
    """Per step of a sharded run, what `clip_and_accumulate` held and ran: the shapes of the sums
    it returned, the physical chunks (engine calls), and the shapes of the tensors it handed to
    `distributed.reduce_scatter_rows` (each one parameter's full-size clipped sum of one chunk;
    the first step also the coverage check's), whether each was handed over inside autograd's
    backward (`inside_backward`), and the most of those full-size tensors alive at once
    (`most_alive`, weak references: 1 when each is freed before the next is formed);
    `in_release`: those run after it, in the step's release. `restore()` undoes the
    instrumentation."""

    def __init__(self, algorithm):
        super().__init__()
        self.calls: list[tuple] = []
        self.inside: list[bool] = []
        self.handed: list[weakref.ref] = []  # the full-size tensors handed over, weakly
        self.most_alive = 0
        self.chunks = 0
        self.algorithm, self.original = algorithm, distributed.reduce_scatter_rows
        clip, engine_sum = algorithm.clip_and_accumulate, algorithm.engine.clipped_sum

        def counted(tensor):
            self.handed = [ref for ref in self.handed if ref() is not None] + [weakref.ref(tensor)]
            self.most_alive = max(self.most_alive, len(self.handed))
            self.calls.append(tuple(tensor.shape))
            self.inside.append(torch._C._current_graph_task_id() != -1)
            return self.original(tensor)

        def chunk(*args, **kwargs):
            self.chunks += 1
            return engine_sum(*args, **kwargs)

        def recorded(batches):
            self.calls.clear()
            self.inside.clear()
            self.chunks, self.most_alive = 0, 0
            sums, tally = clip(batches)
            self.append({"sums": [tuple(v.shape) for v in sums], "reduce_scatters": list(self.calls),
                         "inside_backward": list(self.inside), "most_alive": self.most_alive,
                         "chunks": self.chunks})
            self.calls.clear()
            return sums, tally

        distributed.reduce_scatter_rows = counted
        algorithm.engine.clipped_sum = chunk
        algorithm.clip_and_accumulate = recorded

    def restore(self) -> None:
        distributed.reduce_scatter_rows = self.original
        del self.algorithm.clip_and_accumulate, self.algorithm.engine.clipped_sum  # the instance's own


def last_local_release(algorithm, task, rank: int, world: int):
    """One more step; this rank's rows of the released sums and of their noisy values (the observer
    sees them whole: this rank's rows are the ones it noised)."""
    seen = []
    algorithm.release_observer = lambda name, parts, noisy, mechanism: seen.append((parts[0].values, noisy[0]))
    algorithm.train_step(chunks(LOGICAL_BATCHES[0][rank::world], task), len(LOGICAL_BATCHES))
    return [[v[distributed.row_shard(v.shape[0])] for v in values] for values in seen[0]]


def sum_semantics(rank: int, world: int) -> dict:
    """FSDP2's own reduce-scatter of autograd's gradient (what the coverage check reads) is the
    SUM over the ranks of their gradients, not the mean."""
    cfg = compose([*OFFLINE, "algo=dpadam", "dataset=synthetic", "model=vit"])
    task = build_task(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    plain = task.build_model(cfg.model)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    sharding.shard_model(model, sharding.block_patterns("vit"), torch.device("cpu"))
    batch = task.batch(list(range(8 * rank, 8 * rank + 5 + 3 * rank)))  # different examples and sizes
    task.per_sample_loss(plain, batch).sum().backward()
    expected = {name: p.grad.clone() for name, p in plain.named_parameters()}
    distributed.all_reduce_sum(list(expected.values()))
    task.per_sample_loss(model, batch).sum().backward()
    got = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {"expected": expected, "got": got}


def run(rank: int, world: int, port: int, out: str) -> None:
    become_rank(rank, world, port)
    results: dict = {}
    from helpers.text_data import write_dataset

    TEXT["path"] = write_dataset(Path(out) / f"text{rank}", "boolq", n_train=32, n_test=8).parent
    if rank == 0:  # one process, before any process group exists
        results["reference"] = train(0, 1)
        results["opt_reference"] = train(0, 1, model_name="opt")
        results["ghost_reference"] = train(0, 1, model_name="vit_ghost")
    distributed.init_from_environment()
    results["sharded"] = train(rank, world, teacher=True)
    results["noisy"] = train(rank, world, sigma=NOISY_SIGMA)
    results["sum"] = sum_semantics(rank, world)
    results["opt"] = train(rank, world, teacher=True, model_name="opt")
    results["ghost"] = train(rank, world, teacher=True, model_name="vit_ghost")
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()

"""Multi-process data parallel training under `torchrun` (one device per rank).

    torchrun --nproc_per_node=K -m dpbench.cli algo=dpadam ...

The design keeps ONE privatised release per logical step, identical to the one-process mechanism:

* Poisson sampling over the global dataset: rank 0 draws the logical batch from its
  entropy-seeded sampler and broadcasts the indices; rank r trains on indices[r::K]
  (`dpbench.privacy.sampling.ShardedBatches`).
* Every noisy release (`Algorithm.gaussian_release`) sums each part's clipped per-rank sums over
  the ranks (all-reduce); rank 0 alone adds N(0, std^2) from its entropy-seeded generator and
  broadcasts the noisy result. One generator draws exactly one noise vector, as in one process;
  the alternative (each rank adds std/sqrt(K) from its own generator) has the same distribution
  but spreads the guarantee over K generators and leaves replicas bit-different.
* Division by the global expected batch size qn (unchanged); the reported loss and realised batch
  size are the global ones (all-reduced in `Algorithm.train_step`).
* Model initialisation and public randomness (projectors, directions) are seeded, hence equal on
  all ranks: `check_replicas` asserts it before training.
* Only rank 0 writes results.json, .hydra/ and W&B and prints; every rank evaluates the full test
  set on its (identical) replica, so no rank waits at a collective and the numbers are rank 0's.

Without torchrun (WORLD_SIZE unset or 1) every helper is a no-op and nothing changes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist

from dpbench.errors import UserError


def launched() -> bool:
    """Whether torchrun (or an equivalent launcher) started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0 (or the only process): the one that writes files, logs and prints."""
    return rank() == 0


def init_from_environment() -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); idempotent.

    gloo carries CPU tensors and nccl CUDA tensors (one device per rank: LOCAL_RANK), so the same
    collectives serve device=cpu and device=cuda runs.
    """
    if not launched() or is_distributed():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" means this rank's GPU
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend)
    from dpbench.logging.console import console

    console.quiet = not is_main_process()  # one progress bar, one summary


def backend() -> str | None:
    return dist.get_backend() if is_distributed() else None


def all_reduce_sum(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over the ranks, in place (one collective per tensor: no extra
    parameter-sized buffer, which matters for the largest models)."""
    if is_distributed():
        for tensor in tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensors


def all_reduce_scalars(*values: float) -> list[float]:
    """Sum python floats over the ranks (float64 on the CPU)."""
    if not is_distributed():
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.tolist()


def broadcast(tensors: list[torch.Tensor], source: int = 0) -> list[torch.Tensor]:
    """Overwrite each tensor with rank `source`'s, in place."""
    if is_distributed():
        for tensor in tensors:
            dist.broadcast(tensor, src=source)
    return tensors


def broadcast_object(value: Any, source: int = 0) -> Any:
    """Rank `source`'s picklable value on every rank."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def check_replicas(model: torch.nn.Module) -> None:
    """Fail before training unless every rank holds rank 0's parameters, buffers and global RNG
    state (from which the public seeds of projectors and directions are drawn). Every rank runs
    the same collectives and raises together (a lone failing rank would leave the others waiting)."""
    if not is_distributed():
        return
    differing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        reference = tensor.detach().clone()
        broadcast([reference])
        if not torch.equal(reference, tensor.detach()):
            differing.append(name)
    state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    if broadcast_object(state) != state:
        differing.append("the seeded torch RNG state (public seeds)")
    (ranks_differing,) = all_reduce_scalars(float(bool(differing)))
    if ranks_differing:
        mine = f"here (rank {rank()}): {', '.join(differing[:3])}" if differing else f"not on rank {rank()}"
        raise RuntimeError(
            f"model initialisation differs from rank 0's on {int(ranks_differing)} rank(s), {mine}; "
            "every rank must build the model from the same seed"
        )


def require_data_parallel(algo_cls: type, name: str) -> None:
    """Refuse, with the fix, an algorithm whose step is not a sum of per-rank releases."""
    if not is_distributed():
        return
    if not algo_cls.private:
        raise UserError(
            f"algo={name} is non-private: multi-process runs support private algorithms only "
            "(their releases are summed over ranks); run it in one process, without torchrun"
        )
    if not algo_cls.data_parallel:
        raise UserError(f"algo={name} does not support multi-process data parallel runs; run it without torchrun")

"""Spawning gloo ranks on the CPU: a free port, every rank's saved measurements, and a spawned
process's rank environment."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(run: Callable, world: int, out: Path) -> list[dict]:
    """Start `run(rank, world, port, out)` on `world` spawned processes and load what each rank
    saved as out/rank<r>.pt (one spawn per test module: process start-up dominates)."""
    torch.multiprocessing.start_processes(run, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn")
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def become_rank(rank: int, world: int, port: int) -> None:
    """In a spawned process: one torch thread, and the environment torchrun would set for `rank`
    of `world` (the process group is then started from it)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of a rank's tensor from one process's, relative to the latter's largest entry."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))

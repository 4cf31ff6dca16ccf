"""Spawning gloo ranks on the CPU: a free port, and every rank's saved measurements."""

from __future__ import annotations

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

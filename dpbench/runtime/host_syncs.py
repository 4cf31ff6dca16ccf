"""Counting host syncs: the calls that make the CPU wait for the device (`.item()`, `.tolist()`,
`bool(t)`, `float(t)`, `int(t)` on a tensor).

On a GPU each one stalls the queue of kernels, so a training step should make a bounded number of
them, independent of the number of layers. The counter patches torch.Tensor's methods for the
duration of a `with` block; it works on the CPU, where the same calls would be syncs on a GPU, so
the bound is testable without one (tests/run/test_host_syncs.py, `dpbench-doctor`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")


class HostSyncCounter:
    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    counter = HostSyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}

    def counting(original):
        def method(self, *args, **kwargs):
            counter.count += 1
            return original(self, *args, **kwargs)

        return method

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)

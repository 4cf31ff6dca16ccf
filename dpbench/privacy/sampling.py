"""Batch samplers: Poisson (what the accountants assume) and shuffled fixed-size batches.

Poisson sampling uses Opacus's UniformWithReplacementSampler (each example joins each batch
independently with probability q), driven by an entropy-seeded generator: amplification by
subsampling assumes the adversary does not know which examples were drawn.
"""

from __future__ import annotations

from typing import Iterator

import torch

from dpbench import distributed
from dpbench.privacy.noise import entropy_seed


class PoissonBatches:
    name = "poisson"

    def __init__(self, num_samples: int, sample_rate: float, seed: int | None = None):
        """`seed=None` (every private run): selection from fresh OS entropy. A non-private run may
        pass the experiment seed so that it is reproducible (nothing there is secret)."""
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        generator = torch.Generator()
        generator.manual_seed(entropy_seed() if seed is None else seed)
        self.sample_rate = sample_rate
        self._sampler = UniformWithReplacementSampler(
            num_samples=num_samples, sample_rate=sample_rate, generator=generator
        )

    def __iter__(self) -> Iterator[list[int]]:
        while True:  # the trainer decides when to stop
            yield from self._sampler


class ShuffledBatches:
    """Fixed-size batches from a reshuffled permutation each epoch (seeded, reproducible).

    The accountants' guarantee assumes Poisson sampling; a run with this sampler says so."""

    name = "shuffle"

    def __init__(self, num_samples: int, batch_size: int, seed: int):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            order = torch.randperm(self.num_samples, generator=self.generator).tolist()
            for start in range(0, self.num_samples - self.batch_size + 1, self.batch_size):
                yield order[start : start + self.batch_size]


class ShardedBatches:
    """Data parallel: rank 0 draws each logical batch from `sampler` (over the global dataset)
    and broadcasts its indices; rank r of K trains on indices[r::K]. The shards partition the
    logical batch, so the clipped sums all-reduced over the ranks are the logical batch's sum.
    Other ranks never draw: one entropy-seeded selection, as in one process."""

    def __init__(self, sampler, rank: int, world_size: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.name = sampler.name

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.sampler) if self.rank == 0 else None
        while True:
            indices = distributed.broadcast_object(next(batches) if batches is not None else None)
            yield list(indices)[self.rank :: self.world_size]


def build_sampler(kind: str, num_samples: int, batch_size: int, seed: int, private: bool = True):
    if kind == "poisson":  # private runs never draw their sample from a seed
        sampler = PoissonBatches(num_samples, batch_size / num_samples, None if private else seed)
    elif kind == "shuffle":
        sampler = ShuffledBatches(num_samples, batch_size, seed)
    else:
        from dpbench.errors import UserError

        raise UserError(f"privacy.sampling={kind!r} is not known; use poisson or shuffle")
    if distributed.is_distributed():
        return ShardedBatches(sampler, distributed.rank(), distributed.world_size())
    return sampler

"""Batch samplers: Poisson and shuffled fixed-size batches.

Poisson sampling uses Opacus's UniformWithReplacementSampler (each example joins each batch
independently with probability q), driven by an entropy-seeded generator: amplification by
subsampling assumes the adversary does not know which examples were drawn.

Shuffled batches cut each epoch's random order into n // B batches of exactly B. Their epsilon
assumes no amplification (`dpbench.privacy.mechanisms.ShuffledLedger`), only that each example is
in one batch per epoch and the order does not depend on the data; private runs still draw the
order from fresh entropy, like every other sample selection.
"""

from __future__ import annotations

from typing import Iterator

import torch

from dpbench.runtime import distributed
from dpbench.errors import UserError
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


def batches_per_epoch(cfg, train_size: int) -> int | None:
    """Fixed-size batches in one shuffled epoch (None: Poisson sampling), the rest of the order
    dropped: n // B under replace-one; (n - 1) // B under add/remove-one, so that every epoch
    drops at least one example, which the add/remove bound needs (`ShuffledLedger`)."""
    if cfg.privacy.sampling != "shuffle":
        return None
    batch_size = int(cfg.train.batch_size)
    relation = str(cfg.privacy.neighboring)
    per_epoch = (train_size - 1) // batch_size if relation == "add_remove" else train_size // batch_size
    if per_epoch < 1:
        raise UserError(
            f"privacy.sampling=shuffle with privacy.neighboring=add_remove needs train.batch_size below the {train_size} "
            "training examples (each epoch must leave one out); lower it, or set privacy.neighboring=replace_one"
        )
    return per_epoch


class ShuffledBatches:
    """Fixed-size batches from a fresh permutation each epoch: `batches_per_epoch` batches of
    B slots (default n // B), the rest dropped, so an epoch holds each example at most once.

    The epoch length is planned from public sizes; the realised data may hold fewer examples than
    the slots (`min_slots`: k B, plus the one add/remove leaves out). The order is then drawn over
    `max(n, min_slots)` slots, the slots past the last example empty: a neighbour's extra example
    takes an empty slot (sensitivity C, below the 2C charged), and nothing refuses or branches on
    the realised size. With n >= min_slots this is the plain permutation of n.

    A checkpoint keeps the epoch in progress (`state_dict`): a resumed run finishes that epoch's
    order before drawing a new one, so no example is in two batches of one accounted epoch."""

    name = "shuffle"

    def __init__(self, num_samples: int, batch_size: int, seed: int | None = None, batches_per_epoch: int | None = None,
                 min_slots: int = 0):
        """`seed=None` (every private run): orders from fresh OS entropy; a non-private run may
        pass the experiment seed so that it is reproducible."""
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.batches_per_epoch = num_samples // batch_size if batches_per_epoch is None else batches_per_epoch
        if self.batches_per_epoch < 1:
            raise ValueError(f"an epoch needs at least one batch of {batch_size}, got {self.batches_per_epoch}")
        self.slots = max(num_samples, min_slots, self.batches_per_epoch * batch_size)
        self.seeded = seed is not None
        self.generator = torch.Generator()
        self.generator.manual_seed(entropy_seed() if seed is None else seed)
        self._order: torch.Tensor | None = None  # this epoch's permutation
        self._next = 0  # index of the next batch of the epoch

    def __iter__(self) -> Iterator[list[int]]:
        while True:  # the trainer decides when to stop
            if self._order is None or self._next >= self.batches_per_epoch:
                self._order, self._next = torch.randperm(self.slots, generator=self.generator), 0
            start = self._next * self.batch_size
            self._next += 1
            batch = self._order[start : start + self.batch_size]
            yield batch[batch < self.num_samples].tolist()  # empty slots dropped

    def state_dict(self) -> dict:
        """The epoch in progress (and, for a seeded sampler, the generator that draws the next)."""
        return {"order": self._order, "next": self._next, "generator": self.generator.get_state() if self.seeded else None}

    def load_state_dict(self, state: dict) -> None:
        order = state["order"]
        if order is not None and (order.numel() != self.slots or not 0 <= state["next"] <= self.batches_per_epoch):
            raise ValueError(f"the stored epoch order covers {order.numel()} slots, this run has {self.slots}")
        self._order, self._next = order, int(state["next"])
        if self.seeded and state.get("generator") is not None:
            self.generator.set_state(state["generator"])


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

    def state_dict(self) -> dict | None:
        """Rank 0's sampler state (rank 0 writes checkpoints; the others never draw)."""
        return self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state)


def build_sampler(kind: str, num_samples: int, batch_size: int, seed: int, private: bool = True,
                  batches_per_epoch: int | None = None, sample_rate: float | None = None, relation: str = "add_remove"):
    """The run's sampler (private runs never draw their batches from a seed); `batches_per_epoch`:
    shuffled batches per epoch (`batches_per_epoch(cfg, n)`; None: n // B).

    With a validation split the sampler draws over the realised training part (`num_samples`) at
    the rate and epoch length planned from the public size n (1 - f): `sample_rate` (None: B /
    num_samples) and `batches_per_epoch`. Nothing here depends on the realised size beyond the
    indices drawn: a shuffled epoch longer than the realised part gets empty slots, never a refusal."""
    if kind == "poisson":
        sampler = PoissonBatches(num_samples, batch_size / num_samples if sample_rate is None else sample_rate,
                                 None if private else seed)
    elif kind == "shuffle":
        # a planned epoch: the add/remove bound needs it to leave a slot out (ShuffledLedger)
        slots = 0 if batches_per_epoch is None else batches_per_epoch * batch_size + (relation == "add_remove")
        sampler = ShuffledBatches(num_samples, batch_size, None if private else seed, batches_per_epoch, min_slots=slots)
    else:
        raise UserError(f"privacy.sampling={kind!r} is not known; use poisson or shuffle")
    if distributed.is_distributed():
        return ShardedBatches(sampler, distributed.rank(), distributed.world_size())
    return sampler

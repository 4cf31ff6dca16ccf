"""The noisy release: the one place dpbench adds privacy noise to a value.

`gaussian_release(name, parts, noise=..., sample_rate=..., neighboring=...)` adds N(0, std^2) to
every coordinate of each part and returns the noisy values with the mechanism that ran. A part
(`ReleasePart`) is a sum over one sampled batch, the L2 sensitivity of that sum under add/remove-one
(what the clipping enforces) and the noise std. Parts released together read the same sampled
batch, so they are ONE subsampled Gaussian mechanism whose noise multiplier is that of the
whitened parts (`joint_noise_multiplier`). The mechanism is derived from the noise actually drawn
and the sensitivity the clipping enforces, so the ledger holds what ran, not what was meant to.

It needs no Algorithm: a training step's release goes through `Algorithm.gaussian_release`
(which charges the mechanism to the step), and any other private value (a validation score
under its own mechanism, a diagnostic) calls this function with its own sample rate and relation.

Seams, each named by the release's `name`:
* `charge(mechanism)` is called before the finiteness check, so a release that halts the run is
  charged like one that did not;
* `observer(name, parts, noisy, mechanism)` sees every release that did not halt (dpbench-audit
  records them): the parts then hold the whole global sums the noise was added to and `noisy` the
  whole noisy values, in every layout, on every rank, so that an audit under torchrun sees what a
  one-process audit sees. Under SHARDED and SUMMED_SHARDS the ranks' rows are all-gathered for it
  (`distributed.gather_rows`); only when an observer is attached: a release without one runs no
  extra collective.

Layouts over torchrun ranks (dpbench/runtime/distributed.py):

* REPLICATED (every rank holds whole tensors, its own examples' sums): each part's values are
  first summed over the ranks, in place (the global clipped sum, whose sensitivity is the stated
  one); rank 0 alone draws the noise and broadcasts the noisy values, so one step is one release
  with one noise draw, exactly the one-process mechanism, and the replicas stay bit-identical.
* SHARDED (FSDP-style, each rank keeps only its shard of each tensor): the values are still this
  rank's whole local sums; a sum-reduce-scatter leaves each rank the global sum of its own rows
  (`distributed.row_shard`: torch.chunk's rule along dim 0, FSDP2's Shard(0)), and each rank adds
  noise to its shard from its own entropy-seeded generator. Generators of different processes are
  independent, so the shards together are the global sum plus N(0, std^2) on every coordinate,
  drawn once: the same Gaussian mechanism as REPLICATED. The noisy values returned are the shards.
* SUMMED_SHARDS (SHARDED with the reduce-scatter already done by the caller): the values are this
  rank's shard rows (`distributed.row_shard`, `distributed.row_shard_shape`) of the global sums,
  summed over the ranks before the release, e.g. chunk by chunk and layer by layer as they are
  formed (`DPFirstOrderAlgorithm.clip_and_accumulate` under train.sharding=fsdp, so that no rank
  holds a full-size accumulator). The release runs no collective on them: each rank adds noise
  to its rows from its own generator, as in SHARDED, whose invariants hold unchanged (every
  coordinate is in one rank's rows and gets one N(0, std^2) draw; the observer sees the global
  sums the noise was added to, gathered; the ranks agree on the finiteness check). The sensitivity is
  that of the global sum: the caller's reduce-scatter must be a SUM over every rank, each rank
  entering it alike (the same tensors in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import torch

from dpbench.runtime import distributed
from dpbench.errors import DivergedError
from dpbench.privacy.mechanisms import GaussianMechanism, joint_noise_multiplier
from dpbench.privacy.noise import GaussianNoise


class Layout(str, Enum):
    """How the ranks hold the released tensors (see the module docstring)."""

    replicated = "replicated"
    sharded = "sharded"
    summed_shards = "summed_shards"


REPLICATED = Layout.replicated
SHARDED = Layout.sharded
SUMMED_SHARDS = Layout.summed_shards


@dataclass
class ReleasePart:
    """One privatised quantity: a sum over the batch, the L2 sensitivity of that sum under
    add/remove-one (enforced by clipping), and the std of the Gaussian noise added per coordinate."""

    values: list[torch.Tensor]
    sensitivity: float
    noise_std: float


# Observer of every noisy release (dpbench-audit): (name, parts, noisy values, mechanism).
ReleaseObserver = Callable[[str, list[ReleasePart], list[list[torch.Tensor]], GaussianMechanism], None]


def release_mechanism(parts: Sequence[ReleasePart], sample_rate: float, neighboring: str) -> GaussianMechanism:
    """The one subsampled Gaussian mechanism that releasing `parts` together is."""
    return GaussianMechanism(
        joint_noise_multiplier([(part.noise_std, part.sensitivity) for part in parts]), sample_rate, neighboring)


def gaussian_release(
    name: str,
    parts: Sequence[ReleasePart],
    *,
    noise: GaussianNoise,
    sample_rate: float,
    neighboring: str,
    layout: Layout = REPLICATED,
    observer: ReleaseObserver | None = None,
    charge: Callable[[GaussianMechanism], None] | None = None,
) -> tuple[list[list[torch.Tensor]], GaussianMechanism]:
    """(noisy values per part, the mechanism that ran): N(0, part.noise_std^2) added to every
    coordinate of each part's values, over `layout` (see the module docstring).

    REPLICATED sums the parts' values over the ranks in place; SHARDED reduce-scatters them;
    SUMMED_SHARDS takes them as this rank's rows of the global sums. `noise` draws (an entropy-seeded
    `GaussianNoise`); `sample_rate` and `neighboring` state the mechanism (1.0 for a value read
    from a fixed, not subsampled, set). Raises DivergedError, on every rank alike, when a noisy
    value is not finite."""
    parts = list(parts)
    layout = Layout(layout)
    if layout is Layout.replicated:
        released, noisy = parts, _replicated(parts, noise)
    else:
        released = parts if layout is Layout.summed_shards else [  # summed_shards: reduce-scattered already
            ReleasePart([distributed.reduce_scatter_rows(v) for v in part.values], part.sensitivity, part.noise_std)
            for part in parts]
        noisy = _noised(released, noise)  # each rank its own shard, from its own generator
    mechanism = release_mechanism(parts, sample_rate, neighboring)
    if charge is not None:
        charge(mechanism)  # first: a release that halts the run ran too
    # replicated: every rank checks rank 0's values alike; sharded: the ranks agree on their shards
    _halt_unless_finite(name, noisy, agree=layout is not Layout.replicated)
    if observer is not None:
        if layout is Layout.replicated or not distributed.is_distributed():
            observer(name, released, noisy, mechanism)
        else:  # each rank holds its rows: the observer sees the whole sums and noisy values
            whole_released, whole_noisy = _whole(released, noisy)
            observer(name, whole_released, whole_noisy, mechanism)
    return noisy, mechanism


def _whole(parts: list[ReleasePart], noisy: list[list[torch.Tensor]]) -> tuple[list[ReleasePart], list[list[torch.Tensor]]]:
    """The whole tensors of which each rank holds its rows (`distributed.gather_rows`), for the
    observer: the released parts and the noisy values. One small object collective agrees on the
    whole shapes (a 0-dim tensor's one row is rank 0's, its shard 0-dim), then one all-gather per
    tensor, in the same order on every rank."""
    every = distributed.all_gather_object([[tuple(v.shape) for v in part.values] for part in parts])

    def whole_shape(i: int, k: int) -> tuple:
        first = every[0][i][k]
        return () if not first else (sum(ranks[i][k][0] if ranks[i][k] else 0 for ranks in every), *first[1:])

    shapes = [[whole_shape(i, k) for k in range(len(part.values))] for i, part in enumerate(parts)]
    released = [ReleasePart([distributed.gather_rows(v, shape) for v, shape in zip(part.values, part_shapes)],
                            part.sensitivity, part.noise_std) for part, part_shapes in zip(parts, shapes)]
    return released, [[distributed.gather_rows(v, shape) for v, shape in zip(values, part_shapes)]
                      for values, part_shapes in zip(noisy, shapes)]


def _noised(parts: list[ReleasePart], noise: GaussianNoise) -> list[list[torch.Tensor]]:
    return [[_plus(v, noise.sample(v.shape, part.noise_std)) for v in part.values] for part in parts]


def _replicated(parts: list[ReleasePart], noise: GaussianNoise) -> list[list[torch.Tensor]]:
    for part in parts:
        distributed.all_reduce_sum(part.values)
    if distributed.is_main_process():
        noisy = _noised(parts, noise)
    else:  # receives rank 0's noisy values; the dtype is that of value + fp32 noise
        noisy = [[torch.empty(v.shape, dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
                  for v in part.values] for part in parts]
    for values in noisy:
        distributed.broadcast(values)
    return noisy


def _plus(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """value + noise, into the fresh noise tensor where the result has its dtype (no third tensor)."""
    if noise.dtype not in (torch.float32, torch.float64):  # a narrower noise would put the release on its grid
        raise RuntimeError(f"privacy noise must be drawn in fp32 or wider, got {noise.dtype}; this is a bug, please report it")
    if torch.promote_types(value.dtype, noise.dtype) == noise.dtype and value.shape == noise.shape:
        return noise.add_(value)
    return value + noise


def _all_finite(noisy: list[list[torch.Tensor]]) -> bool:
    """One host sync: each tensor's sum, which a non-finite entry makes non-finite (a tenth of the
    time of an elementwise check); only a sum that overflowed from finite entries is then checked
    entry by entry."""
    values = [v for part in noisy for v in part]
    if not values or bool(torch.isfinite(torch.stack([v.sum(dtype=torch.float32) for v in values])).all()):
        return True
    return all(bool(torch.isfinite(v).all()) for v in values)


def _halt_unless_finite(name: str, noisy: list[list[torch.Tensor]], agree: bool = False) -> None:
    """Stop on a non-finite released value. Halting is itself a release: this one is a function of
    the noisy release only (clipping bounds every example, and a non-finite example has clip factor
    0), so it reveals nothing the release did not. `agree`: the ranks hold different values (shards)
    and decide together, so that no rank halts alone and leaves the others in a collective."""
    finite = _all_finite(noisy)
    if agree:
        (failed,) = distributed.all_reduce_scalars(0.0 if finite else 1.0)
        finite = failed == 0
    if not finite:
        raise DivergedError(f"the noisy {name} release is not finite: lower train.lr (the model diverged)")

"""One rank of the sharded-release test (tests/privacy/test_release.py), started by torch.multiprocessing
with the gloo backend on the CPU. Each rank releases its own local sums in the SHARDED layout,
once through reduce-scatter and once through the all-reduce fallback, and their reduce-scattered
rows in the SUMMED_SHARDS layout (an observer attached: it sees the whole sums and noisy values),
gathers reduce-scattered rows back (`distributed.gather_rows`), and saves what it saw to
<out>/rank<r>.pt for the test to compare."""

from __future__ import annotations

from pathlib import Path

import torch

from dpbench.runtime import distributed
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.release import SHARDED, SUMMED_SHARDS, ReleasePart, gaussian_release
from helpers.ranks import become_rank

# Shapes released together: rows that split unevenly over 2 and 3 ranks, a vector, a scalar.
SHAPES = [(2_001, 20), (20_003,), ()]
SENSITIVITY, STD = 2.0, 3.0
SAMPLE_RATE = 0.25


def local_values(rank: int) -> list[torch.Tensor]:
    """This rank's local sums: a public function of (rank, shape), so the test recomputes them."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(shape, generator=generator) * (rank + 1) for shape in SHAPES]


def release(rank: int, layout=SHARDED) -> dict:
    """SHARDED: this rank's local sums; SUMMED_SHARDS: this rank's rows of their sum over the ranks
    (reduce-scattered before the release, as DP-SGD's clip_and_accumulate does chunk by chunk)."""
    seen = []
    values = local_values(rank)
    if layout is SUMMED_SHARDS:
        values = [distributed.reduce_scatter_rows(v) for v in values]
    noisy, mechanism = gaussian_release(
        "gradient", [ReleasePart(values, SENSITIVITY, STD)], noise=GaussianNoise("cpu"),
        sample_rate=SAMPLE_RATE, neighboring="add_remove", layout=layout,
        observer=lambda name, parts, values, m: seen.append(([v.clone() for v in parts[0].values],
                                                             [v.clone() for v in values[0]])),
    )
    return {"noisy": [v.clone() for v in noisy[0]], "observed": seen[0][0], "observed_noisy": seen[0][1],
            "mechanism": (mechanism.noise_multiplier, mechanism.sample_rate, mechanism.neighboring)}


def gathered(rank: int) -> dict:
    """`distributed.gather_rows` of this rank's reduce-scattered rows of each shape (uneven rows, a
    0-dim tensor), the second by its row count; and of rows fewer than the ranks (some hold none)."""
    rows = [distributed.reduce_scatter_rows(v) for v in local_values(rank)]
    whole = [distributed.gather_rows(v, shape) for v, shape in zip(rows, SHAPES)]
    whole.append(distributed.gather_rows(rows[1], SHAPES[1][0]))  # a row count: the rest of the shape follows
    few = torch.arange(2.0 * 3).reshape(2, 3) * (rank + 1)  # 2 rows: with 3 ranks, rank 2 holds none
    whole.append(distributed.gather_rows(distributed.reduce_scatter_rows(few), few.shape))
    return {"whole": whole}


def run(rank: int, world: int, port: int, out: str) -> None:
    become_rank(rank, world, port)
    distributed.init_from_environment()
    results = {"reduce_scatter": release(rank), "summed_shards": release(rank, SUMMED_SHARDS), "gathered": gathered(rank)}
    results["fell_back"] = sorted(distributed._NO_REDUCE_SCATTER)  # gloo builds without reduce-scatter
    distributed._NO_REDUCE_SCATTER.add(distributed.backend())  # as a build without reduce-scatter
    results["all_reduce"] = release(rank)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()

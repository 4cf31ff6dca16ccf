"""train.physical_batch_size is memory only: a logical batch split into physical chunks releases
the same clipped sums (and makes the same update) as the batch in one piece, for every private
algorithm on the registry and every per-sample gradient mode (noise off)."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithms import build_algorithm

from dpbench.algorithms import ALGORITHMS, import_all

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

import_all()
# Overrides that make every part of an algorithm work on the tiny two-Linear model.
PROJECTED = ["algo.rank=4", "algo.projected_modules=['1','3']", "algo.update_interval=2"]
OVERRIDES = {
    "grape": PROJECTED,
    # rank 2 < the rank of the last layer's gradient (<= 3: softmax rows sum to 0), so the SVD
    # never picks a direction of ~0 singular value, where Adam would amplify rounding
    "galore_naive": ["algo.rank=2", "algo.projected_modules=['1','3']", "algo.update_interval=2"],
    "dpdr": ["algo.decomposition_steps=3"],  # decomposes at steps 1 and 2
    "dcdpsgd": ["algo.subspace_dim=8"],
    "diff": ["algo.difference_clip=0.2"],
    "diff2": ["algo.difference_clip=0.2", "algo.restart_interval=2"],
}
# dplora needs a language model (adapters on attention projections): tested in test_language.
VARIANTS = [(name, OVERRIDES.get(name, [])) for name in sorted(ALGORITHMS.names())
            if ALGORITHMS.get(name).private and name != "dplora"]
VARIANTS += [("dpadam", ["algo.per_sample=ghost"]), ("dpadam", ["algo.per_sample=bk"]),
             ("grape", [*PROJECTED, "algo.per_sample=bk"])]
LOGICAL_BATCHES = [list(range(0, 13)), list(range(20, 31)), list(range(40, 54))]


def releases_and_update(algo: str, overrides: list[str], physical: int | None):
    """Every release's summed values over 3 steps (no noise) and the final parameters."""
    algorithm, task, _ = build_algorithm(algo, *overrides, sigma=0.0, clip=0.5, batch=13.0)
    released: list[torch.Tensor] = []
    algorithm.release_observer = lambda name, parts, noisy, mechanism: released.extend(
        v.detach().clone().flatten() for part in parts for v in part.values
    )
    for step, indices in enumerate(LOGICAL_BATCHES):
        size = physical or len(indices)
        algorithm.train_step([task.batch(indices[i : i + size]) for i in range(0, len(indices), size)], step)
    return released, [p.detach().clone() for p in algorithm.model.parameters()]


@pytest.mark.parametrize("algo,overrides", VARIANTS, ids=[" ".join([a, *o[-1:]]) for a, o in VARIANTS])
def test_physical_chunks_release_the_logical_batchs_clipped_sum(algo, overrides):
    whole, whole_params = releases_and_update(algo, overrides, None)
    assert whole and any(v.abs().sum() > 0 for v in whole)
    for physical in (4, 1):
        chunked, chunked_params = releases_and_update(algo, overrides, physical)
        assert len(chunked) == len(whole)
        for got, want in zip(chunked, whole):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(chunked_params, whole_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

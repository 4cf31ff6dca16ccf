"""dpbench.privacy.release: the one noisy release, without an Algorithm, in every layout.

The SHARDED layout runs on spawned gloo ranks (2 and 3 processes, CPU), and SUMMED_SHARDS on the
rows reduce-scattered before it (no second reduce-scatter): the noisy shards put
together are the global sum plus N(0, std^2) per coordinate, the ranks' noise is independent, and
the mechanism is the replicated one. One process, it is the REPLICATED release."""

from __future__ import annotations

import pytest
import torch
from helpers.ranks import spawn_ranks
from scipy import stats

from dpbench.runtime import distributed
from dpbench.errors import DivergedError
from dpbench.privacy.mechanisms import GaussianMechanism
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.release import REPLICATED, SHARDED, SUMMED_SHARDS, ReleasePart, gaussian_release


def seeded_noise(seed: int) -> GaussianNoise:
    noise = GaussianNoise("cpu")
    noise.generator.manual_seed(seed)  # tests only: a run's generator is never seeded
    return noise


def test_a_scalar_released_without_an_algorithm_under_its_own_mechanism():
    """E.g. a validation score: one value, its own sensitivity, sample rate and relation."""
    score = torch.tensor(0.75)
    seen = []
    (noisy,), mechanism = gaussian_release(
        "validation_score", [ReleasePart([score], 0.01, 0.05)], noise=GaussianNoise("cpu"),
        sample_rate=1.0, neighboring="replace_one", observer=lambda *args: seen.append(args),
    )
    assert noisy[0].shape == () and noisy[0].dtype == torch.float32 and float(noisy[0]) != 0.75
    assert (mechanism.noise_multiplier, mechanism.sample_rate, mechanism.neighboring) == (pytest.approx(5.0), 1.0, "replace_one")
    ((name, parts, values, observed_mechanism),) = seen
    assert name == "validation_score" and parts[0].values[0] is score and values[0][0] is noisy[0]
    assert observed_mechanism == mechanism


def test_one_process_sharded_is_the_replicated_release():
    values = [torch.randn(7, 3), torch.randn(5), torch.tensor(2.0)]
    releases = {}
    for layout in (REPLICATED, SHARDED, SUMMED_SHARDS):
        parts = [ReleasePart([v.clone() for v in values[:2]], 1.0, 2.0), ReleasePart([values[2].clone()], 0.5, 4.0)]
        releases[layout] = gaussian_release("gradient", parts, noise=seeded_noise(7), sample_rate=0.1,
                                            neighboring="add_remove", layout=layout)
    (replicated, m_replicated), (sharded, m_sharded) = releases[REPLICATED], releases[SHARDED]
    assert m_replicated == m_sharded == releases[SUMMED_SHARDS][1]
    for a, b, c in zip(replicated, sharded, releases[SUMMED_SHARDS][0]):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))


def test_a_release_that_halts_is_charged_and_not_observed():
    charged, seen = [], []
    with pytest.raises(DivergedError, match="noisy gradient release is not finite"):
        gaussian_release("gradient", [ReleasePart([torch.tensor([1.0, float("nan")])], 1.0, 1.0)],
                         noise=GaussianNoise("cpu"), sample_rate=0.5, neighboring="add_remove",
                         charge=charged.append, observer=lambda *args: seen.append(args))
    assert charged == [GaussianMechanism(1.0, 0.5)] and seen == []


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_row_shards_follow_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world) if rows else ()
    shards = [torch.arange(rows)[distributed.row_shard(rows, r, world)] for r in range(world)]
    assert torch.equal(torch.cat(shards), torch.arange(rows))
    for r, shard in enumerate(shards):
        assert torch.equal(shard, chunks[r] if r < len(chunks) else torch.arange(0))



@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    from helpers.release_worker import run

    world = request.param
    return world, spawn_ranks(run, world, tmp_path_factory.mktemp(f"release{world}"))


@pytest.mark.slow  # starts processes
def test_gather_rows_is_the_whole_tensor_on_every_rank(ranks):
    """Uneven rows, a vector, a 0-dim tensor (rank 0's one row), a row count for a shape, and fewer
    rows than ranks (some hold none): every rank gets the whole sum of its reduce-scattered rows."""
    from helpers.release_worker import SHAPES, local_values

    world, results = ranks
    totals = [sum(local_values(r)[i] for r in range(world)) for i in range(len(SHAPES))]
    few = sum(torch.arange(2.0 * 3).reshape(2, 3) * (r + 1) for r in range(world))
    for result in results:
        whole = result["gathered"]["whole"]
        for got, want in zip(whole, [*totals, totals[1], few]):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gather_rows_in_one_process_is_the_tensor_itself():
    tensor = torch.randn(3, 2)
    assert distributed.gather_rows(tensor, tensor.shape) is tensor
    scalar = torch.tensor(1.5)
    assert distributed.gather_rows(scalar, ()) is scalar


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("path", ["reduce_scatter", "all_reduce", "summed_shards"])
def test_sharded_release_is_the_global_sum_plus_independent_noise_of_the_stated_std(ranks, path):
    from helpers.release_worker import (
        SAMPLE_RATE,
        SENSITIVITY,
        SHAPES,
        STD,
        local_values,
    )

    world, results = ranks
    totals = [sum(local_values(r)[i] for r in range(world)) for i in range(len(SHAPES))]
    noises = []
    for rank, result in enumerate(results):
        got = result[path]
        assert got["mechanism"] == (STD / SENSITIVITY, SAMPLE_RATE, "add_remove")  # the replicated one
        own = []
        for total, observed, observed_noisy, noisy in zip(totals, got["observed"], got["observed_noisy"], got["noisy"]):
            rows = total.reshape(1) if total.dim() == 0 else total
            mine = distributed.row_shard(rows.shape[0], rank, world)
            expected = rows[mine]
            if total.dim() == 0 and expected.numel():
                expected = expected.reshape(())
            assert noisy.shape == expected.shape  # the release returns this rank's rows
            # the observer (dpbench-audit) sees the whole global sum and the whole noisy values on every rank
            assert observed.shape == observed_noisy.shape == total.shape
            torch.testing.assert_close(observed, total, rtol=1e-5, atol=1e-5)
            noisy_rows = observed_noisy.reshape(1) if total.dim() == 0 else observed_noisy
            assert torch.equal(noisy_rows[mine].reshape(noisy.shape), noisy)  # this rank's rows, as drawn
            own.append((noisy.double() - expected.double()).flatten())
        noises.append(torch.cat(own))
    # every coordinate of every tensor is held by exactly one rank
    assert sum(n.numel() for n in noises) == sum(t.numel() for t in totals)
    noise = torch.cat(noises)
    statistic = float((noise**2).sum() / STD**2)  # chi-square with one degree per coordinate
    low, high = stats.chi2.ppf([1e-9, 1 - 1e-9], noise.numel())
    assert low < statistic < high, statistic / noise.numel()
    assert abs(float(noise.mean())) < 7 * STD / noise.numel() ** 0.5
    # independent across ranks: no rank repeats another's draw, and their noise is uncorrelated
    size = min(n.numel() for n in noises)
    for a in range(world):
        for b in range(a + 1, world):
            correlation = float(torch.corrcoef(torch.stack([noises[a][:size], noises[b][:size]]))[0, 1])
            assert abs(correlation) < 7 / size**0.5, (a, b, correlation)

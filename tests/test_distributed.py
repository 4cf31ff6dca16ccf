"""Multi-process data parallel (torchrun) on the CPU with gloo and 2 processes: a K=2 step equals
the one-process step with the noise off, the noise of a release is N(0, sigma^2 C^2) once (not K
times, not 1/K), the ranks share rank 0's Poisson batch, and a torchrun run writes one results.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from algorithm_helpers import tiny_model
from conftest import REPO
from distributed_worker import ALGORITHMS_COMPARED, LOGICAL_BATCHES, NOISE_COORDINATES, run
from scipy import stats

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' measurements (one spawn for the whole module: process start-up dominates)."""
    out = tmp_path_factory.mktemp("ranks")
    torch.multiprocessing.start_processes(run, args=(WORLD, free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("algo", sorted(ALGORITHMS_COMPARED))
def test_two_process_steps_equal_the_one_process_steps_without_noise(ranks, algo):
    reference = ranks[0]["reference"][algo]
    for rank in ranks:
        sharded = rank["sharded"][algo]
        for got, want in zip(sharded["params"], reference["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # the reported loss and batch size are the logical batch's, the ledger the same
        for (loss, size, mechanisms), (ref_loss, ref_size, ref_mechanisms) in zip(sharded["steps"], reference["steps"]):
            assert size == ref_size
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert mechanisms == ref_mechanisms
    assert [s[1] for s in reference["steps"]] == [len(b) for b in LOGICAL_BATCHES]
    initial = list(tiny_model().parameters())  # the steps moved every trained tensor
    assert all(not torch.allclose(p, q) for p, q in zip(reference["params"], initial))


def test_noisy_steps_keep_the_replicas_identical(ranks):
    """Rank 0's single noise draw is broadcast: both ranks apply bit-identical updates."""
    for a, b in zip(ranks[0]["noisy_dpsgd"]["params"], ranks[1]["noisy_dpsgd"]["params"]):
        assert torch.equal(a, b)
    without_noise = ranks[0]["sharded"]["dpsgd"]["params"]
    assert any(not torch.allclose(a, b) for a, b in zip(ranks[0]["noisy_dpsgd"]["params"], without_noise))


def test_the_release_adds_sigma_c_noise_once_to_the_sum_over_ranks(ranks):
    noisy = [r["noise"]["noisy"].double() for r in ranks]
    assert torch.equal(noisy[0], noisy[1])  # one release, broadcast
    noise = noisy[0] - sum(range(1, WORLD + 1))  # the values were rank + 1: their sum is 3
    std = 1.5 * 2.0  # sigma C
    statistic = float((noise**2).sum() / std**2)  # chi-square with NOISE_COORDINATES degrees of freedom
    p_value = 2 * min(stats.chi2.cdf(statistic, NOISE_COORDINATES), stats.chi2.sf(statistic, NOISE_COORDINATES))
    assert p_value > 1e-3, (statistic / NOISE_COORDINATES, p_value)
    variance = float(noise.var())
    assert variance == pytest.approx(std**2, rel=0.05)  # not K sigma^2 C^2 (18), not sigma^2 C^2 / K (4.5)
    assert abs(float(noise.mean())) < 5 * std / NOISE_COORDINATES**0.5
    assert all(r["noise"]["mechanisms"] == [1.5] for r in ranks)  # the ledger: multiplier std / C


def test_ranks_train_on_shards_of_rank_zeros_poisson_batch(ranks):
    for shard0, shard1 in zip(ranks[0]["shards"], ranks[1]["shards"]):
        logical = sorted(shard0 + shard1)
        assert len(set(logical)) == len(logical)
        assert logical[0::2] == shard0 and logical[1::2] == shard1  # indices[r::K] of one draw


def test_non_private_and_per_example_releases_are_refused_with_the_fix(ranks):
    refusals = ranks[1]["refusals"]
    assert "non-private" in refusals["adam"] and "without torchrun" in refusals["adam"]
    assert "non-private" in refusals["mezo"]
    assert "does not support multi-process" in refusals["dcdpsgd"]


def test_differing_initialisation_fails_on_every_rank(ranks):
    assert "rank 1" in ranks[1]["replica_check"] and "weight" in ranks[1]["replica_check"]
    assert "not on rank 0" in ranks[0]["replica_check"]


def test_torchrun_writes_one_results_json_with_the_ledger_of_all_steps(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
               "-m", "dpbench.cli", "train.steps=3", "logger=none", "device=cpu", "algo=dpsgd",
               "dataset=synthetic", "train.batch_size=32"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = tmp_path.glob("outputs/runs/*/results.json")
    assert len(list(tmp_path.glob("outputs/runs/*"))) == 1  # every rank used rank 0's folder
    results = json.loads(results_file.read_text())
    assert results["status"] == "completed" and results["throughput"]["world_size"] == 2
    privacy = results["privacy"]
    assert privacy["steps"] == 3 and sum(entry.get("count", 1) for entry in privacy["ledger"]) == 3
    assert results["privacy"]["epsilon"] > 0
    assert result.stderr.count("results:") == 1  # one summary: only rank 0 prints

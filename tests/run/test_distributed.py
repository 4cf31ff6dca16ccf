"""Multi-process data parallel (torchrun) on the CPU with gloo and 2 processes: a K=2 step equals
the one-process step with the noise off, the noise of a release is N(0, sigma^2 C^2) once (not K
times, not 1/K), the ranks share rank 0's Poisson batch, and a torchrun run writes one results.json.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers.algorithms import tiny_model
from helpers.cli import torchrun
from helpers.distributed_worker import (
    ALGORITHMS_COMPARED,
    LOGICAL_BATCHES,
    NOISE_COORDINATES,
    run,
)
from helpers.ranks import free_port, spawn_ranks
from scipy import stats

WORLD = 2



@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' measurements (one spawn for the whole module: process start-up dominates)."""
    return spawn_ranks(run, WORLD, tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow  # starts processes
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


@pytest.mark.slow  # starts processes
def test_noisy_steps_keep_the_replicas_identical(ranks):
    """Rank 0's single noise draw is broadcast: both ranks apply bit-identical updates."""
    without_noise = ranks[0]["sharded"]["dpsgd"]["params"]
    assert len(ranks) == WORLD and len(ranks[0]["noisy_dpsgd"]["params"]) == len(ranks[1]["noisy_dpsgd"]["params"]) \
        == len(without_noise) > 0  # the comparisons below are not over empty lists
    for a, b in zip(ranks[0]["noisy_dpsgd"]["params"], ranks[1]["noisy_dpsgd"]["params"]):
        assert torch.equal(a, b)
    assert any(not torch.allclose(a, b) for a, b in zip(ranks[0]["noisy_dpsgd"]["params"], without_noise))


@pytest.mark.slow  # starts processes
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


@pytest.mark.slow  # starts processes
def test_ranks_train_on_shards_of_rank_zeros_poisson_batch(ranks):
    for shard0, shard1 in zip(ranks[0]["shards"], ranks[1]["shards"]):
        logical = sorted(shard0 + shard1)
        assert len(set(logical)) == len(logical)
        assert logical[0::2] == shard0 and logical[1::2] == shard1  # indices[r::K] of one draw


@pytest.mark.slow  # starts processes
def test_non_private_and_per_example_releases_are_refused_with_the_fix(ranks):
    refusals = ranks[1]["refusals"]
    assert "non-private" in refusals["adam"] and "without torchrun" in refusals["adam"]
    assert "non-private" in refusals["mezo"]
    assert "does not support multi-process" in refusals["dcdpsgd"]


@pytest.mark.slow  # starts processes
def test_differing_initialisation_fails_on_every_rank(ranks):
    assert "rank 1" in ranks[1]["replica_check"] and "weight" in ranks[1]["replica_check"]
    assert "not on rank 0" in ranks[0]["replica_check"]


@pytest.mark.slow  # starts processes
def test_torchrun_writes_one_results_json_with_the_ledger_of_all_steps(tmp_path):
    result = torchrun("train.steps=3", "logger=none", "device=cpu", "algo=dpsgd", "dataset=synthetic",
                      "train.batch_size=32", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = tmp_path.glob("outputs/runs/*/results.json")
    assert len(list(tmp_path.glob("outputs/runs/*"))) == 1  # every rank used rank 0's folder
    results = json.loads(results_file.read_text())
    assert results["status"] == "completed" and results["throughput"]["world_size"] == 2
    privacy = results["privacy"]
    assert privacy["steps"] == 3 and sum(entry.get("count", 1) for entry in privacy["ledger"]) == 3
    assert results["privacy"]["epsilon"] > 0
    compute = results["compute"]  # every rank's passes, summed (a collective every rank entered)
    assert compute["per_example"] == 3.0 and compute["forwards"] == compute["backwards"] == compute["examples"] > 0
    assert result.stderr.count("results:") == 1  # one summary: only rank 0 prints


# --- agreements, stops, devices, generators ----------------------------------------------------
@pytest.mark.slow  # starts processes
def test_a_differing_privacy_plan_fails_on_every_rank_in_one_line(ranks):
    assert all(rank["agreements"]["same_plan"] is None for rank in ranks)
    mine, theirs = ranks[1]["agreements"]["other_plan"], ranks[0]["agreements"]["other_plan"]
    assert mine.startswith("UserError: the privacy plan on rank 1 differs from rank 0's (noise_multiplier 2.5 vs 1.5)")
    assert theirs.startswith("UserError: rank 1 failed checking the privacy plan")
    assert "\n" not in mine + theirs


@pytest.mark.slow  # starts processes
def test_a_failure_on_one_rank_stops_every_rank_at_the_same_point(ranks):
    assert all(rank["agreements"]["nothing_failed"] is None for rank in ranks)
    assert ranks[1]["agreements"]["diverged_on_1"] == "DivergedError: training loss became nan"
    # rank 0 raises the same kind, so it records the run as diverged
    assert ranks[0]["agreements"]["diverged_on_1"] == "DivergedError: rank 1 failed in step 3: DivergedError: training loss became nan"
    assert ranks[0]["agreements"]["crashed_on_0"] == "ValueError: disk full"
    assert ranks[1]["agreements"]["crashed_on_0"] == "PeerFailure: rank 0 failed in step 4: ValueError: disk full"


@pytest.mark.slow  # starts processes
def test_every_rank_continues_from_its_own_generators(ranks):
    for rank in ranks:
        assert torch.equal(rank["generators"]["restored"], rank["generators"]["expected"]) and not rank["generators"]["notes"]
    assert not torch.equal(ranks[0]["generators"]["expected"], ranks[1]["generators"]["expected"])
    # a checkpoint of another world size: rank 0's CPU generators everywhere, with a note
    assert torch.equal(ranks[0]["generators"]["other_world_draw"], ranks[1]["generators"]["other_world_draw"])
    assert all("written by 1 process(es), this run has 2" in rank["generators"]["other_world_notes"][0] for rank in ranks)


@pytest.mark.slow  # starts processes
def test_the_process_group_is_left_at_the_end(ranks):
    assert len(ranks) == WORLD and all(rank["shut_down"] for rank in ranks)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("where", ["after_collectives", "inside_step"])
def test_a_rank_that_fails_makes_every_rank_exit_non_zero_promptly(tmp_path, where):
    from helpers.distributed_failures import run as failing_run

    context = torch.multiprocessing.start_processes(
        failing_run, args=(WORLD, free_port(), str(tmp_path), where), nprocs=WORLD, start_method="spawn", join=False)
    for process in context.processes:
        process.join(timeout=240)  # a guard: a rank left blocked in a collective would hang here
    codes = [process.exitcode for process in context.processes]
    for process in context.processes:
        if process.exitcode is None:
            process.kill()
    assert None not in codes, f"a rank hung: exit codes {codes}"
    assert all(code != 0 for code in codes), codes
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(WORLD)]
    if where == "after_collectives":  # both stop at step 2, rank 0 naming rank 1's error
        assert said[1] == "RuntimeError: injected failure after the step's collectives"
        assert said[0] == "PeerFailure: rank 1 failed in step 2: RuntimeError: injected failure after the step's collectives"
        # rank 0 evaluated step 2 too, but a failed step publishes nothing (a rerun redraws it)
        assert (tmp_path / "published0.txt").read_text().split() == ["1"]
    else:  # rank 0 waited inside the step's collective: rank 1 closes the group, which ends that wait
        assert said[1] == "RuntimeError: injected failure before the step's collectives"
        assert "Connection closed by peer" in said[0] or said[0].startswith("PeerFailure: another rank stopped")


class FakeCuda:
    """Stands in for torch.cuda on a machine with `count` GPUs: records set_device calls."""

    def __init__(self, monkeypatch, count: int, world: int = 2, local_rank: int = 1):
        from dpbench.runtime import distributed

        self.set_devices: list[int] = []
        monkeypatch.setattr(distributed, "_run_device_type", None)  # bind_device's record stays in this test
        monkeypatch.setattr(distributed, "cuda_device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_devices.append)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_cpu_ranks_never_set_a_cuda_device(monkeypatch):
    from dpbench.runtime import distributed

    cuda = FakeCuda(monkeypatch, count=1, local_rank=3)  # more CPU ranks than GPUs
    distributed.bind_device(torch.device("cpu"))
    assert cuda.set_devices == []


def test_a_cuda_rank_binds_its_local_gpu_when_it_exists(monkeypatch):
    from dpbench.runtime import distributed

    cuda = FakeCuda(monkeypatch, count=2, local_rank=1)
    distributed.bind_device(torch.device("cuda"))
    assert cuda.set_devices == [1]
    single = FakeCuda(monkeypatch, count=2, world=1, local_rank=0)  # one process (no torchrun): untouched
    distributed.bind_device(torch.device("cuda"))
    assert single.set_devices == []


@pytest.mark.parametrize("count", [0, 1])
def test_a_cuda_rank_without_its_gpu_is_a_one_line_error(monkeypatch, count):
    from dpbench.runtime import distributed
    from dpbench.errors import UserError

    cuda = FakeCuda(monkeypatch, count=count, local_rank=1)  # e.g. one visible GPU per task
    with pytest.raises(UserError, match=f"local rank 1 needs GPU 1, but this process sees {count} GPU") as refused:
        distributed.bind_device(torch.device("cuda"))
    assert cuda.set_devices == [] and "\n" not in str(refused.value) and "device=cpu" in str(refused.value)


def test_the_cli_leaves_the_process_group_however_it_ends(monkeypatch, tmp_path):
    from dpbench import cli
    from dpbench.runtime import distributed

    monkeypatch.chdir(tmp_path)  # Hydra's run folder
    left = []
    monkeypatch.setattr(distributed, "shutdown", lambda: left.append(True))
    monkeypatch.setattr(sys, "argv", ["dpbench", "privacy.epsilon=-1", "logger=none", "dataset=synthetic"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == cli.EXIT_BAD_INPUT and left == [True]


def test_the_privacy_plan_fingerprint_holds_what_the_ranks_must_share(tiny_cfg):
    from dpbench.run import setup

    fingerprint = setup(tiny_cfg("algo=dpsgd", "privacy.sampling=shuffle")).privacy.fingerprint()
    assert {"noise_multiplier", "clip_norm", "sample_rate", "clipping", "neighboring", "accountant", "algo", "steps",
            "sampling", "batches_per_epoch", "delta"} <= set(fingerprint)
    assert fingerprint["algo"]["name"] == "dpsgd" and fingerprint["steps"] == 3 and fingerprint["batches_per_epoch"] == 7


def test_cuda_generators_are_restored_per_rank_and_only_onto_as_many_gpus(monkeypatch):
    from dpbench.runtime import checkpoint, distributed

    gpu_states = {"rank0": [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)],
                  "rank1": [torch.tensor([3], dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8)]}
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(distributed, "_run_device_type", "cuda")
    per_rank, draws = [], []
    for rank in (0, 1):  # what each rank's checkpoint entry holds
        torch.manual_seed(10 + rank)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda rank=rank: gpu_states[f"rank{rank}"])
        per_rank.append(checkpoint.rng_states())
        draws.append(torch.rand(2))
    assert per_rank[1]["cuda"] == gpu_states["rank1"]
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert checkpoint.restore_rank_rng_states(per_rank) == []
    assert restored == [gpu_states["rank1"]] and torch.equal(torch.rand(2), draws[1])  # rank 1's, not rank 0's
    monkeypatch.setattr(distributed, "cuda_device_count", lambda: 1)  # resumed where it sees one GPU
    (note,) = checkpoint.restore_rank_rng_states(per_rank)
    assert len(restored) == 1 and "CUDA RNG states of 2 GPU(s), this process sees 1" in note
    monkeypatch.setattr(distributed, "_run_device_type", "cpu")  # a CPU run on a GPU node never asks CUDA
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("a CPU run initialised CUDA"))
    assert checkpoint.rng_states()["cuda"] == []

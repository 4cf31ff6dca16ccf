"""train.sharding=fsdp (dpbench/runtime/sharding.py): FSDP2 on the CPU with gloo and 2 processes. With the
noise off, each step's released clipped sum equals one process's at the same parameters and five
DP-Adam steps (bk on a micro ViT and a tiny OPT with its tied head, ghost on the ViT) end where one
process's do; with it on, each coordinate gets
N(0, sigma^2 C^2) once, the ranks' shards independently; each rank holds about half the parameter
and optimizer bytes; FSDP2's reduce-scatter is a SUM. The one-line refusals run without processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import torchrun
from helpers.ranks import relative, spawn_ranks
from helpers.sharding_worker import CLIP, LOGICAL_BATCHES, NOISY_SIGMA, run
from scipy import stats

from dpbench.algorithms import ALGORITHMS
from dpbench.errors import UserError

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' measurements (one spawn for the whole module)."""
    return spawn_ranks(run, WORLD, tmp_path_factory.mktemp("sharded_ranks"))


# model -> (sharded run, one process): DP-Adam with bk, and with ghost on the ViT
RUNS = {"vit": ("sharded", "reference"), "opt": ("opt", "opt_reference"), "vit_ghost": ("ghost", "ghost_reference")}


@pytest.mark.slow  # starts processes
def test_every_block_is_wrapped_and_the_tied_head_left_to_the_root(ranks):
    assert all(rank["sharded"]["wrapped"] == ["blocks.0", "blocks.1"] for rank in ranks)
    assert all(rank["opt"]["wrapped"] == ["model.decoder.layers.0", "model.decoder.layers.1", "tied:lm_head"]
               for rank in ranks)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("model", sorted(RUNS))
def test_each_steps_release_equals_one_process_at_the_same_parameters(ranks, model):
    """Rank 0 forms the one-process clipped sum of the step's examples at the sharded run's
    parameters (measured: at most 2e-7 relative, sums in another order)."""
    run_name, _ = RUNS[model]
    taught = ranks[0][run_name]["taught"]
    assert len(taught) == len(LOGICAL_BATCHES)
    for rank in ranks:
        released = rank[run_name]["releases"]
        assert len(released) == len(LOGICAL_BATCHES)  # one release a step, the step with one example too
        for (sums, _), want in zip(released, taught):
            for got, expected in zip(sums, want):
                assert got.shape == expected.shape
                assert relative(got, expected) < 1e-6


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("model", sorted(RUNS))
def test_five_dp_adam_steps_end_where_one_process_does(ranks, model):
    """Measured: 2.6e-6 relative (ViT), 1e-7 (OPT). atol: an attention key's bias starts at 0 and
    its gradient is 0 in exact arithmetic, so it holds only rounding (below 1e-7)."""
    run_name, reference_name = RUNS[model]
    reference = ranks[0][reference_name]
    for rank in ranks:
        sharded = rank[run_name]
        assert sharded["params"].keys() == reference["params"].keys()
        for name, want in reference["params"].items():
            torch.testing.assert_close(sharded["params"][name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()) + 1e-7)
        for (loss, size, mechanisms), (ref_loss, ref_size, ref_mechanisms) in zip(sharded["steps"], reference["steps"]):
            assert size == ref_size and mechanisms == ref_mechanisms
            assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert [s[1] for s in ranks[0]["reference"]["steps"]] == [len(b) for b in LOGICAL_BATCHES]


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("run_name", ["sharded", "opt", "ghost", "noisy"])
def test_the_accumulators_are_this_ranks_shard_rows_reduce_scattered_chunk_by_chunk(ranks, run_name):
    """Each step's clipped sums are held as this rank's shard rows (half of each weight's rows),
    each physical chunk's per-parameter full-size sum reduce-scattered as it is formed, one at a
    time (bk: after the backward, in the parameters' order; ghost: inside its second backward, as
    each hook forms it), the same number of times and in the same order on both ranks (padding
    chunks too), and the release reduce-scatters nothing."""
    parameters = len(ranks[0][run_name]["full_shapes"])
    ghost = run_name == "ghost"
    for rank in ranks:
        measured = rank[run_name]
        full = measured["full_shapes"]
        assert len(measured["accumulated"]) == len(LOGICAL_BATCHES)
        assert any(local[0] < whole[0] for local, whole in zip(measured["local_shapes"], full))
        for step, held in enumerate(measured["accumulated"]):
            assert held["sums"] == measured["local_shapes"]  # shard rows, not full size
            assert held["most_alive"] == 1  # one full-size sum at a time, freed before the next is formed
            coverage = full if step == 0 else []  # the engine's one-time coverage check
            scattered, inside = held["reduce_scatters"], held["inside_backward"]
            assert scattered[: len(coverage)] == coverage and not any(inside[: len(coverage)])
            per_chunk = [scattered[len(coverage) + c * parameters:][:parameters] for c in range(held["chunks"])]
            assert len(scattered) == len(coverage) + parameters * held["chunks"]
            if not ghost:  # after the backward, in the parameters' order
                assert per_chunk == [full] * held["chunks"] and not any(inside)
            else:  # every parameter once a chunk, in the backward's order: most within the backward
                assert all(sorted(chunk) == sorted(full) and chunk != full for chunk in per_chunk)
                within = [sum(inside[len(coverage) + c * parameters:][:parameters]) for c in range(held["chunks"])]
                assert all(n > parameters // 2 for n in within), within
            assert held["in_release"] == 0
    # several physical chunks a step, as many on both ranks (rank 1 pads where it has fewer or none),
    # and the same reduce-scatters in the same order
    chunks = [[held["chunks"] for held in rank[run_name]["accumulated"]] for rank in ranks]
    assert chunks[0] == chunks[1] and max(chunks[0]) >= 2 and parameters
    assert [held["reduce_scatters"] for held in ranks[0][run_name]["accumulated"]] == \
        [held["reduce_scatters"] for held in ranks[1][run_name]["accumulated"]]


@pytest.mark.slow  # starts processes
def test_each_coordinate_gets_sigma_c_noise_once(ranks):
    noisy = ranks[0]["noisy"]
    noise = torch.cat([(n - s).flatten().double() for sums, noises in noisy["releases"] for s, n in zip(sums, noises)])
    d, std = noise.numel(), NOISY_SIGMA * CLIP
    statistic = float((noise**2).sum() / std**2)  # chi-square with d degrees of freedom
    p_value = 2 * min(stats.chi2.cdf(statistic, d), stats.chi2.sf(statistic, d))
    assert p_value > 1e-3, (statistic / d, p_value)  # not K sigma^2 C^2, not sigma^2 C^2 / K
    assert all(m == [NOISY_SIGMA] for _, _, m in noisy["steps"])  # the ledger: one mechanism a step
    # the gathered release is the same on both ranks (each shard released once)
    for (a, _), (b, _) in zip(ranks[0]["noisy"]["releases"], ranks[1]["noisy"]["releases"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow  # starts processes
def test_the_ranks_shards_draw_uncorrelated_noise(ranks):
    first, second = (rank["noisy"]["local_noise"].double() for rank in ranks)
    d = min(first.numel(), second.numel())
    correlation = float(torch.corrcoef(torch.stack([first[:d], second[:d]]))[0, 1])
    assert abs(correlation) < 5 / d**0.5, correlation


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("model", sorted(RUNS))
def test_each_rank_holds_about_half_the_parameters_and_optimizer_state(ranks, model):
    run_name, reference_name = RUNS[model]
    reference = ranks[0][reference_name]
    for key in ("parameter_bytes", "optimizer_state_bytes"):
        held = [rank[run_name][key] for rank in ranks]
        assert sum(held) == reference[key]  # the shards partition one process's tensors
        assert all(0.45 < h / reference[key] < 0.55 for h in held), (key, held, reference[key])  # measured 0.49-0.51


@pytest.mark.slow  # starts processes
def test_fsdp_reduce_scatters_gradients_as_a_sum(ranks):
    for rank in ranks:
        summed = rank["sum"]
        for name, want in summed["expected"].items():
            torch.testing.assert_close(summed["got"][name], want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # starts processes
def test_torchrun_trains_sharded_and_records_it(tmp_path):
    result = torchrun("train.sharding=fsdp", "algo=dpadam", "algo.per_sample=bk", "model=vit", "train.steps=3",
                      "train.eval_every=2", "device=cpu", "logger=none", "dataset=synthetic", "train.batch_size=32",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = tmp_path.glob("outputs/runs/*/results.json")
    results = json.loads(results_file.read_text())
    assert results["status"] == "completed" and results["throughput"]["sharding"] == "fsdp"
    assert results["throughput"]["world_size"] == 2 and results["privacy"]["steps"] == 3
    # after the evaluations' forwards and the end of training, rank 0 holds its rows of every
    # parameter, the root's included (FSDP2 keeps the root gathered after a forward: resharded)
    from dpbench.api import compose
    from dpbench.runtime.distributed import row_shard
    from dpbench.run import setup

    model = setup(compose(["model=vit", "dataset=synthetic", "algo=dpadam", "logger=none", "device=cpu",
                           "privacy.noise_multiplier=1"])).model
    rows = [row_shard(p.shape[0], 0, 2) for p in model.parameters()]
    expected = sum((r.stop - r.start) * p[0].numel() * p.element_size() for r, p in zip(rows, model.parameters()))
    assert results["memory"]["parameter_bytes"] == expected


# --- refusals (no processes) ---------------------------------------------------------------------
def _cfg(algo: str = "dpadam", per_sample: str | None = "bk", model: str = "vit", **train):
    """The keys check_supported reads (a composed config takes 0.4 s each)."""
    from omegaconf import OmegaConf

    algo_cfg = {"name": algo, **({} if per_sample is None else {"per_sample": per_sample})}
    return OmegaConf.create({"algo": algo_cfg, "model": {"name": model},
                             "train": {"sharding": "fsdp", "precision": "fp32", "checkpoint_every": None, **train}})


def _refusal(monkeypatch, cfg, world: int = 2) -> str:
    from dpbench.runtime import sharding

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(UserError) as refused:
        sharding.check_supported(cfg, ALGORITHMS)
    message = str(refused.value)
    assert "\n" not in message and "supports algo=dpadam|dpsgd|grape with algo.per_sample=bk|ghost and algo=dpzero" in message
    return message


def test_fsdp_in_one_process_is_refused_in_one_line(monkeypatch):
    assert _refusal(monkeypatch, _cfg(), world=1).startswith("it needs several processes")


@pytest.mark.parametrize("cfg, problem", [
    (_cfg("adam", None), "algo=adam is not supported"),
    (_cfg("galore"), "algo=galore is not supported"),
    (_cfg("mezo", None), "algo=mezo is not supported"),
    (_cfg("grape", "materialize"), "algo.per_sample=materialize is not supported"),
    (_cfg("dpdr"), "algo=dpdr is not supported"),
    (_cfg("dcdpsgd"), "algo=dcdpsgd is not supported"),
    (_cfg(per_sample="materialize"), "algo.per_sample=materialize is not supported"),
    (_cfg(precision="bf16"), "train.precision=bf16 is not supported"),
    (_cfg(model="cnn"), "model=cnn names no transformer blocks"),
])
def test_unsupported_combinations_are_refused_naming_what_is_supported(monkeypatch, cfg, problem):
    assert problem in _refusal(monkeypatch, cfg)


def test_supported_combinations_and_the_default_pass(monkeypatch):
    from dpbench.runtime import sharding

    monkeypatch.setenv("WORLD_SIZE", "2")
    sharding.check_supported(_cfg("dpsgd"), ALGORITHMS)
    sharding.check_supported(_cfg("dpadam", "ghost"), ALGORITHMS)
    sharding.check_supported(_cfg("grape", "bk"), ALGORITHMS)  # replicated releases: tests/run/test_sharded_replicated.py
    sharding.check_supported(_cfg("grape", "ghost"), ALGORITHMS)
    sharding.check_supported(_cfg("dpzero", None), ALGORITHMS)  # no engine: forwards only
    sharding.check_supported(_cfg(checkpoint_every=2), ALGORITHMS)  # sharded checkpoints: tests/run/test_sharded_checkpoint.py
    none = _cfg("adam", None)
    none.train.sharding = "none"
    sharding.check_supported(none, ALGORITHMS)  # train.sharding=none: nothing to check
    assert sharding.block_patterns("opt") == ("*decoder.layers.*",)


def test_block_patterns_name_the_outermost_blocks():
    from torch import nn

    from dpbench.runtime import sharding

    model = nn.Module()
    model.blocks = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    assert [name for name, _ in sharding.block_modules(model, ("blocks.*",))] == ["blocks.0", "blocks.1"]


def test_the_cli_refuses_fsdp_in_one_process_in_one_line(tiny_cfg):
    from dpbench.run import setup

    with pytest.raises(UserError, match="^it needs several processes.*train.sharding=fsdp supports"):
        setup(tiny_cfg("train.sharding=fsdp", "algo=dpadam", "algo.per_sample=bk", "model=vit"))


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_is_refused_or_run_as_its_class_declares(monkeypatch, name):
    """The registry's declaration (`shardable`, `per_example_engine`) decides, for every algorithm."""
    from dpbench.runtime import sharding

    monkeypatch.setenv("WORLD_SIZE", "2")
    algo_cls = ALGORITHMS.get(name)
    cfg = _cfg(name, "bk" if algo_cls.per_example_engine else None)
    if algo_cls.stated("shardable"):
        sharding.check_supported(cfg, ALGORITHMS)
        assert name in sharding.supported(ALGORITHMS)
    else:
        assert f"algo={name} is not supported" in _refusal(monkeypatch, cfg)

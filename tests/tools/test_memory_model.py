"""The memory model (dpbench/tools/benchmarks/memory_model.py) against hand counts on a tiny model,
and OPT-6.7B's parameter and DP-Adam state bytes built on the meta device (no memory, offline)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpbench.algorithms.projected_adam import make_projection
from dpbench.tools.benchmarks.memory_model import (
    estimate,
    estimate_model,
    main,
    reduce_scatter_bytes,
    shaped_model,
    shard_numel,
    sharded_bytes,
)


def tiny():
    # 0: Linear(3, 4) 16 parameters, 1: LayerNorm(4) 8, 2: Linear(4, 2, no bias) 8: 32 in all
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))


def rows(est):
    return {what.strip(): size for what, size, _ in est.rows}


def inputs(batch=2, tokens=5):
    return {"input": torch.zeros(batch, tokens, 3, device="meta")}


def test_bk_one_rank_counts_every_byte_by_hand():
    est = estimate_model(tiny(), inputs(), algo="dpadam", engine="bk", batch=2, tokens=5)
    r = rows(est)
    assert est.parameters == 32
    assert r["parameters / K"] == 32 * 4 and r["gradients / K"] == 32 * 4
    assert r["optimizer state / K"] == 2 * 32 * 4 and r["clipped-sum accumulators"] == 32 * 4
    # Linear 1: a [2,5,3] + g [2,5,4]; Linear 2: a [2,5,4] + g [2,5,2] (fp32)
    assert r["layer inputs + output grads"] == (30 + 40 + 40 + 20) * 4
    assert r["instantiated (norms, others)"] == 2 * 8 * 4  # LayerNorm: B x (weight + bias) fp32
    # Linear 1: T*T = 25 >= 3*4, instantiated B*4*3 + its bias B*4; Linear 2: 25 >= 8, B*2*4; LayerNorm 64
    assert r["norm work (one layer)"] == 2 * 12 * 4 + 2 * 4 * 4
    assert est.per_example_bytes == 520 + 64 + 128
    assert est.total == 128 + 128 + 256 + 128 + 712
    assert "gathered (FSDP2 all-gather)" not in r


def test_ghost_keeps_every_input_but_one_output_gradient():
    est = estimate_model(tiny(), inputs(), algo="dpsgd", engine="ghost", batch=2, tokens=5)
    r = rows(est)
    assert r["optimizer state / K"] == 0  # DP-SGD without momentum
    assert r["layer inputs (all layers)"] == (30 + 40 + 40) * 4  # both Linears' and the LayerNorm's inputs
    assert r["one layer's output grad + norm"] == 40 * 4 + 128  # Linear 1: g [2,5,4] + its instantiated norm work


def test_materialize_keeps_b_gradients_of_every_parameter():
    r = rows(estimate_model(tiny(), inputs(), algo="dpadam", engine="materialize", batch=2, tokens=5))
    assert r["per-example gradients"] == 2 * 32 * 4


def test_two_ranks_shard_rows_as_torch_chunk_and_gather_two_blocks_and_the_root():
    est = estimate_model(tiny(), inputs(), algo="dpadam", engine="bk", batch=2, tokens=5, world_size=2,
                         block_patterns=("0", "2"))
    r = rows(est)
    # rank 0: Linear 1 weight 2 of 4 rows (6) + bias 2, LayerNorm 2 + 2, Linear 2 weight 1 of 2 rows (4)
    assert r["parameters / K"] == 16 * 4 and r["gradients / K"] == 16 * 4 and r["optimizer state / K"] == 2 * 16 * 4
    # this rank's rows of the sums, and one parameter's full-size sum at a time (bk): the largest,
    # Linear 1's [4, 3] weight, with its reduce-scatter's output rows (2 of 4; 4 rows need no padding)
    assert r["clipped-sum accumulators / K"] == 16 * 4 and "clipped-sum accumulators" not in r
    assert r["clipped-sum working sum"] == 12 * 4 + 6 * 4
    assert r["gathered (FSDP2 all-gather)"] == 2 * 16 * 4 + 8 * 4  # 2 x the largest block + the LayerNorm (root)
    assert r["per-example work (bk, B=2, T=5)"] == 712  # not sharded
    assert shard_numel((5, 3), 2) == 9 and shard_numel((5, 3), 4) == 6 and shard_numel((), 8) == 1


def test_materialize_holds_one_chunks_full_size_sums_before_reduce_scattering_them():
    r = rows(estimate_model(tiny(), inputs(), algo="dpsgd", engine="materialize", batch=2, tokens=5, world_size=2,
                            block_patterns=("0", "2")))
    assert r["clipped-sum accumulators / K"] == 16 * 4
    assert r["clipped-sum working sum"] == 32 * 4 + 6 * 4  # every parameter's sum + the largest output rows


def test_ghost_reduce_scatters_each_sum_inside_its_second_backward_one_parameter_at_a_time():
    r = rows(estimate_model(tiny(), inputs(), algo="dpsgd", engine="ghost", batch=2, tokens=5, world_size=2,
                            block_patterns=("0", "2")))
    assert r["clipped-sum accumulators / K"] == 16 * 4
    assert r["clipped-sum working sum"] == 12 * 4 + 6 * 4  # as bk: the largest parameter's sum + its output rows


def test_reduce_scatter_buffers_pad_rows_to_a_multiple_of_k():
    assert reduce_scatter_bytes((4, 3), 2) == 6 * 4  # output rows only
    assert reduce_scatter_bytes((4, 3), 3) == (6 * 3 + 2 * 3) * 4  # a padded [6, 3] copy + 2 rows
    assert reduce_scatter_bytes((), 2) == (2 + 1) * 4  # one row padded to 2, + its output row


def test_grape_moments_and_sums_are_projected():
    model = tiny()
    projection = make_projection(0, "0", model[0].weight.shape, 1)  # [4, 3] -> (4, 1)
    r = rows(estimate_model(model, inputs(), algo="grape", engine="bk", batch=2, tokens=5,
                            projected={model[0].weight: projection}))
    released = 4 + 4 + 8 + 8  # projected weight, bias, LayerNorm, Linear 2
    assert r["clipped-sum accumulators"] == released * 4 and r["optimizer state / K"] == 2 * released * 4
    # train.sharding=fsdp: DP-GRAPE's release and moments are replicated, whole on every rank
    r = rows(estimate_model(model, inputs(), algo="grape", engine="bk", batch=2, tokens=5, world_size=2,
                            block_patterns=("0", "2"), projected={model[0].weight: projection}))
    assert r["gradients / K"] == released * 4 and r["optimizer state / K"] == 2 * released * 4
    assert r["clipped-sum accumulators"] == released * 4  # summed before the all-reduce, whole
    assert r["parameters / K"] == 16 * 4  # the weights are sharded


def test_grape_materialize_forms_projected_per_example_gradients():
    # DP-GRAPE's grad sampler (algorithms/grape.py ProjectedLinear) returns [B, r, in] for a
    # projected weight: B x the released values, not B x every parameter
    model = tiny()
    projection = make_projection(0, "0", model[0].weight.shape, 1)  # [4, 3] -> (4, 1)
    r = rows(estimate_model(model, inputs(), algo="grape", engine="materialize", batch=2, tokens=5,
                            projected={model[0].weight: projection}))
    assert r["per-example gradients"] == 2 * (4 + 4 + 8 + 8) * 4
    r = rows(estimate_model(model, inputs(), algo="dpadam", engine="materialize", batch=2, tokens=5))
    assert r["per-example gradients"] == 2 * 32 * 4


def test_max_batch_is_linear_in_the_batch():
    est = estimate_model(tiny(), inputs(), algo="dpadam", engine="bk", batch=2, tokens=5)
    fixed = est.total - est.per_example_bytes
    assert est.max_batch(fixed + 10 * 356) == 10 and est.max_batch(fixed - 1) == 0


@pytest.mark.slow  # builds OPT-6.7B on fake tensors (a few seconds)
def test_opt_6_7b_dp_adam_state_is_107_gb_and_an_eighth_per_gpu_at_k8():
    from omegaconf import OmegaConf

    from dpbench.tools.benchmarks.memory_trace import tracing_mode

    with tracing_mode():  # fake tensors: shapes only
        model, info = shaped_model(OmegaConf.create({"model": {"name": "opt", "size": "6.7b", "path": None}}))
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in model.parameters())
    assert 6.6e9 < numel < 6.7e9 and info["vocab"] == 50272
    weights_grads_moments = 4 * numel * 4  # fp32 weights, gradients and Adam's two moments
    assert abs(weights_grads_moments / 1e9 - 107) < 1.0
    per_gpu = 4 * sharded_bytes(shapes, 8, 4)
    assert abs(per_gpu / 1e9 - 13.4) < 0.2


@pytest.mark.slow  # composes the config and runs OPT-6.7B's forward on meta (a few seconds)
@pytest.mark.parametrize("engine, total_gib", [("bk", 23.3), ("ghost", 21.5)])
def test_opt_6_7b_dp_adam_at_k8_shards_its_accumulators(engine, total_gib):
    overrides = ["model=opt", "model.size=6.7b", "dataset=squad", "algo=dpadam", f"algo.per_sample={engine}",
                 "train.physical_batch_size=1", "train.precision=fp32"]
    est = estimate(overrides, 8, 1, 512)
    r = rows(est)
    assert r["clipped-sum accumulators / K"] == r["gradients / K"]  # the released shard's rows
    # one parameter's full-size sum: the [50272, 4096] embedding tied to the head, 0.77 GiB + 1/8
    # (ghost too: each sum reduce-scattered inside its second backward as formed; 24.9 GiB when the
    # chunk's sums were all formed first)
    assert r["clipped-sum working sum"] == 50272 * 4096 * 4 * 9 // 8
    # bk: 44.1 GiB with full-size accumulators; ghost: 45.6 GiB with one chunk's full-size sums at once
    assert (total_gib - 0.1) * 2**30 < est.total < (total_gib + 0.1) * 2**30


def test_the_command_prints_the_table_and_the_verdict(capsys):
    main(["--world-size", "1", "2", "--budget-gib", "1", "--seq-len", "16", "--no-traced", "--", "model=opt", "model.size=tiny",
          "dataset=squad", "algo=dpadam", "algo.per_sample=bk", "train.physical_batch_size=2"])
    out = capsys.readouterr().out
    assert out.count("parameters / K") == 2 and "K=2" in out and "gathered (FSDP2 all-gather)" in out
    assert "fits in 1 GiB" in out and "B=2 examples of T=16 tokens" in out


def test_max_batch_sharding_prints_the_same_table(capsys):
    from dpbench.tools.benchmarks import max_batch

    max_batch.main(["--sharding", "--world-size", "2", "--budget-mib", "1024", "--", "model=opt", "model.size=tiny",
                    "dataset=squad", "algo=dpadam", "algo.per_sample=bk", "train.physical_batch_size=1"])
    out = capsys.readouterr().out
    assert "K=2" in out and "clipped-sum accumulators" in out and "fits in 1 GiB" in out


def test_one_process_largest_batch_is_bisected_on_the_traced_step(monkeypatch, capsys):
    """max_batch --sharding at K = 1 (and memory_model with a budget) reads the traced step, not the
    table's linear rows: here a traced step of 100 MiB + 3 MiB per example, so 1 GiB fits B = 308."""
    from dpbench.tools.benchmarks import max_batch, memory_trace

    traced = []

    def predict(overrides, batch, seq_len=None, **_):
        traced.append(batch)
        return {"reserved_bytes": (100 + 3 * batch) * 2**20}

    monkeypatch.setattr(memory_trace, "predict_step_peak", predict)
    max_batch.main(["--sharding", "--world-size", "1", "--budget-mib", "1024", "--", "model=opt", "model.size=tiny",
                    "dataset=squad", "algo=dpadam", "algo.per_sample=bk", "train.physical_batch_size=1"])
    out = capsys.readouterr().out
    assert "traced: largest physical batch that fits in 1 GiB: 308 (" in out, out[-400:]
    assert 308 in traced and 309 in traced and len(traced) < 20


def test_the_fsdp_launcher_runs_one_rank_per_gpu_and_opts_in_to_slurm_ranks():
    from omegaconf import OmegaConf

    from dpbench.paths import config_dir

    launcher = OmegaConf.load(f"{config_dir()}/hydra/launcher/slurm_fsdp.yaml")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8 and launcher.nodes == 1
    assert any("DPBENCH_RANKS_FROM_SLURM=1" in line for line in launcher.setup)


@pytest.mark.slow  # BERT-base's and MiniLM's shapes built, stepped and traced (fake tensors)
@pytest.mark.parametrize("overrides, tokens", [
    (["model=bert", "+model.size=base", "model.trained_blocks=1", "algo=dpsgd", "train.physical_batch_size=32"], 128),
    (["model=minilm", "algo=dpadam"], None),  # the real tier's own run: T = 48, physical B = 64
])
def test_the_analytic_table_builds_the_model_a_run_builds_and_agrees_with_the_trace(overrides, tokens):
    """The table counts what trains (BERT-base: the top block and the head, 7.09 M of 109.5 M) and
    the frozen weights apart, within 15% of the traced step of the same command (it was 11.7x)."""
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak

    overrides = [*overrides, "dataset=rt_snippets", "algo.per_sample=materialize"]
    est = estimate(overrides, 1, tokens=tokens)
    rows = {name: (size, note) for name, size, note in est.rows}
    frozen = int(rows["frozen parameters / K"][1].split()[0].replace(",", ""))
    assert est.parameters < 0.25 * (est.parameters + frozen)
    traced = predict_step_peak(overrides, seq_len=tokens)["allocated_bytes"]
    assert 0.85 <= est.total / traced <= 1.15, (est.total, traced)

"""The traced memory model (dpbench/tools/benchmarks/memory_trace.py) against dpbench's own step run on
real tensors and measured by the same tracker: the fake trace must predict the real peak."""

from __future__ import annotations

import pytest
import torch
from helpers.toy_algorithms import partial_toy  # noqa: F401 (a fixture)

from dpbench.algorithms import ALGORITHMS
from dpbench.tools.benchmarks.memory_trace import MEMTRACKER_TORCH, RESERVED_SLACK, predict_step_peak, trace

VIT = ["model=vit", "model.size=micro", "dataset=synthetic", "dataset.image_size=16", "dataset.patch_size=4"]
ROBERTA = ["model=roberta", "model.size=tiny", "dataset=sst2"]
OPT = ["model=opt", "model.size=tiny", "dataset=boolq"]
# three small configs for each engine, and for DPZero: (overrides, batch, tokens)
CONFIGS = [(VIT + ["algo=dpadam"], 6, None), (ROBERTA + ["algo=dpsgd"], 4, 24), (OPT + ["algo=grape"], 3, 20)]
ENGINE_CASES = [(overrides + [f"algo.per_sample={engine}"], batch, tokens)
                for engine in ("materialize", "ghost", "bk") for overrides, batch, tokens in CONFIGS]
ZEROTH_CASES = [(VIT + ["algo=dpzero"], 6, None), (ROBERTA + ["algo=dpzero"], 4, 24), (OPT + ["algo=dpzero"], 3, 20)]


def test_memtracker_is_the_version_the_self_check_ran_with():
    # MemTracker is a private torch API: a new torch must pass the slow self-check below before
    # MEMTRACKER_TORCH is moved to it
    assert torch.__version__.startswith(MEMTRACKER_TORCH), (torch.__version__, MEMTRACKER_TORCH)


def within(fake: dict, real: dict, tolerance: float = 0.05) -> bool:
    return abs(fake["allocated_bytes"] - real["allocated_bytes"]) <= tolerance * real["allocated_bytes"]


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_a_fake_trace_predicts_the_real_step_of_a_tiny_vit():
    overrides = VIT + ["algo=dpadam", "algo.per_sample=bk"]
    fake, real = trace(overrides, batch=4, fake=True), trace(overrides, batch=4, fake=False)
    assert real["allocated_bytes"] > 0 and within(fake, real), (fake, real)


@pytest.mark.slow  # 12 configs, each built and stepped twice on fake and on real tensors (about 2 minutes)
@pytest.mark.parametrize("overrides, batch, tokens", ENGINE_CASES + ZEROTH_CASES)
def test_the_trace_equals_dpbench_s_own_cpu_step_within_5_percent(overrides, batch, tokens):
    fake = trace(overrides, batch=batch, seq_len=tokens, fake=True)
    real = trace(overrides, batch=batch, seq_len=tokens, fake=False)
    assert within(fake, real), (overrides, fake["allocated_bytes"], real["allocated_bytes"])


@pytest.mark.slow  # every registered algorithm traced once (about 2 minutes)
@pytest.mark.parametrize("algo", ALGORITHMS.names())
def test_the_traced_prediction_runs_every_registered_algorithm(algo):
    """Its own step on fake tensors: DC-DPSGD's value-dependent shapes (a draw's kept directions, the
    score histogram) and DP-GD0th's sphere direction (a norm read as 0) included."""
    traced = predict_step_peak([*VIT, f"algo={algo}"], batch=4)
    assert traced["allocated_bytes"] > 0 and any(f"algo={algo}" in a for a in traced["assumptions"])


def test_the_memory_predictor_traces_an_algorithm_its_analytic_table_does_not_model(partial_toy, capsys):
    """`python -m dpbench.tools.benchmarks.memory_model -- algo=<new>`: a note, then the traced step;
    with --no-traced, one line and exit status 2 (no traceback)."""
    from dpbench.tools.benchmarks.memory_model import EXIT_BAD_INPUT, main

    assert main(["--batch", "4", "--", *VIT, *partial_toy]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: the analytic table models algo=dpsgd|dpadam|grape, not algo=partial: the traced "
                          "prediction below runs its own step") and "traced step (one process" in out
    assert main(["--no-traced", "--", *VIT, *partial_toy]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "algo=partial" in captured.err


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_the_prediction_grows_with_the_batch_and_states_its_assumptions():
    overrides = VIT + ["algo=dpadam", "algo.per_sample=materialize"]
    small, large = predict_step_peak(overrides, batch=2), predict_step_peak(overrides, batch=8)
    assert large["allocated_bytes"] > small["allocated_bytes"]
    assert large["reserved_bytes"] == int(large["allocated_bytes"] * (1 + RESERVED_SLACK))
    assert any("algo.per_sample=materialize" in a for a in large["assumptions"])
    assert large["by_category"]["Parameter"] > 0


def test_max_batch_predicted_bisects_on_the_prediction():
    from dpbench.tools.benchmarks.max_batch import MIB, predicted_search

    def predict(overrides, batch):  # affine in the batch, as a step's memory is: 100 MiB + 3 MiB per example
        return {"reserved_bytes": (100 + 3 * batch) * MIB}

    best, traces = predicted_search(["algo=dpadam"], 100 + 3 * 37 + 1, start=8, predict=predict)
    assert best == 37 and traces < 12
    assert predicted_search([], 99, start=8, predict=predict)[0] == 0  # not even one example fits
    assert predicted_search([], 10**9, start=8, limit=20, predict=predict)[0] == 20


@pytest.mark.slow  # BERT-base traced twice (the fast tier's budget)
def test_a_sentence_classifier_traces_and_fused_dropout_drops_the_attention_probabilities():
    # BERT-base, top block trained: CPU torch's SDPA with dropout takes the math path, which keeps the
    # trained block's [B, heads, T, T] probabilities (and mask); CUDA's fused kernel, modelled by
    # fused_dropout, keeps neither
    overrides = ["model=bert", "+model.size=base", "model.trained_blocks=1", "dataset=rt_snippets", "algo=sgd"]
    batch, tokens = 8, 128  # the block's activations, not its gradients, at the peak
    math_path = predict_step_peak(overrides, batch=batch, seq_len=tokens, fused_dropout=False)
    fused = predict_step_peak(overrides, batch=batch, seq_len=tokens, fused_dropout=True)
    assert math_path["allocated_bytes"] - fused["allocated_bytes"] >= batch * 12 * tokens * tokens * 4
    assert any("fused SDPA" in a for a in fused["assumptions"])


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_an_image_model_is_traced_on_the_input_its_task_gives_it():
    """digits declares no image size in its config: the trace reads it from the data set (1 x 8 x 8),
    as the run's task does, not a default of 32 x 32 (16 times the tokens per image)."""
    prediction = predict_step_peak(["algo=grape", "train.batch_size=32"])
    assert "B=32 examples of (1, 8, 8)" in prediction["assumptions"]


@pytest.mark.slow  # OPT-125m's shapes traced (fake tensors) twice
def test_a_zeroth_order_step_on_a_causal_lm_stays_at_its_inference_floor():
    """DPZero scores a candidate by its label word: the traced step holds no [R, T, V] logits, so
    its peak is within 1.1x a no-gradient forward to the last hidden state plus the scored
    positions' logits (built apart from the task's loss). With every position's fp32 log-softmax
    (dpbench before the change) the same step traced at 3,793 MB against this floor's 807 MB (4.7x)."""
    result = trace(["model=opt", "model.size=125m", "dataset=sst2", "algo=dpzero"], batch=8, seq_len=512,
                   inference_floor=True)
    assert result["allocated_bytes"] <= 1.1 * result["inference_floor_bytes"]
    assert "scored tokens per row: the last 1 (one label-word token per candidate)" in result["assumptions"]

"""Compute in forward-pass equivalents (dpbench/algorithms/compute.py): what the steps count as they
run matches the analytic count (a forward 1, a backward 2, per example), every registered
algorithm's declaration matches what it runs, and train.compute_budget sets the steps from it."""

from __future__ import annotations

import pytest
from helpers.algorithms import build_algorithm
from helpers.config import OFFLINE, compose

from dpbench.algorithms import ALGORITHMS, algorithm_class
from dpbench.errors import UserError
from dpbench.run import planned_steps

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

SIZES = (5, 7)  # two physical chunks of a logical batch of 12
SMALL_SUBSPACE = "algo.subspace_dim=4"  # DC-DPSGD's whitening of a k = 200 subspace takes seconds on a busy core


def run_steps(algo: str, *overrides: str, steps: int = 2, sizes=SIZES):
    """(the algorithm after `steps` steps of the same batch in chunks of `sizes`, its config)."""
    algorithm, task, cfg = build_algorithm(algo, *overrides)
    images, labels = task.batch(list(range(sum(sizes))))
    chunks, start = [], 0
    for size in sizes:
        chunks.append((images[start:start + size], labels[start:start + size]))
        start += size
    for step in range(steps):
        algorithm.train_step(chunks, step)
    return algorithm, cfg


# (algo, overrides, chunk sizes, forwards and backwards per example of a step)
ANALYTIC = [
    ("dpsgd", (), SIZES, 1, 1),  # materialize: one forward, one backward
    ("dpsgd", ("algo.per_sample=ghost",), SIZES, 1, 2),  # ghost clipping: a second (reweighted) backward
    ("dpzero", (), SIZES, 2, 0),  # two forwards (theta +- lambda z), no backward
    ("dcdpsgd", (SMALL_SUBSPACE,), SIZES, 1, 1),  # threshold mode: each chunk scored and clipped in one pass
    ("dcdpsgd", (SMALL_SUBSPACE, "algo.tail_selection=rank"), SIZES, 2, 2),  # rank, several chunks: pass 2 recomputes
    ("dcdpsgd", (SMALL_SUBSPACE, "algo.tail_selection=rank"), (12,), 1, 1),  # rank, one chunk: pass 1's gradients reused
]


@pytest.mark.parametrize("algo,overrides,sizes,forwards,backwards", ANALYTIC)
def test_the_count_is_the_passes_that_ran(algo, overrides, sizes, forwards, backwards):
    algorithm, cfg = run_steps(algo, *overrides, sizes=sizes)
    examples = 2 * sum(sizes)
    tally = algorithm.compute
    assert (tally.forwards, tally.backwards, tally.examples) == (forwards * examples, backwards * examples, examples)
    assert tally.forward_equivalents == forwards * examples + 2 * backwards * examples
    declared = type(algorithm).forward_equivalents_per_example(cfg.algo, len(sizes))
    assert tally.per_example == declared == forwards + 2 * backwards


def overrides_for(algo: str) -> tuple[str, ...]:
    """What the tiny Sequential model needs (LoRA targets) or what makes two steps a whole cycle."""
    if algo in ("lora", "dplora"):
        return ("algo.target_modules=[1,3]",)
    if algo == "dcdpsgd":
        return (SMALL_SUBSPACE,)
    if algo == "diff2":
        return ("algo.restart_interval=2",)  # a restart step and a difference step
    return ()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGORITHMS.names())
def test_every_algorithm_declares_what_its_steps_spend(algo):
    """The declaration (what train.compute_budget plans with) is what the steps count."""
    algorithm, cfg = run_steps(algo, *overrides_for(algo))
    assert algorithm.compute.per_example == pytest.approx(
        type(algorithm).forward_equivalents_per_example(cfg.algo, len(SIZES)))


BUDGET = [*OFFLINE, "dataset=synthetic", "train.batch_size=32"]


@pytest.mark.parametrize("algo,overrides,per_example", [
    ("dpadam", (), 3), ("dpadam", ("algo.per_sample=ghost",), 5), ("dpzero", (), 2),
    ("dcdpsgd", ("train.physical_batch_size=16", "algo.tail_selection=rank"), 6), ("dcdpsgd", (), 3),
    ("dcdpsgd", ("train.physical_batch_size=16",), 3),
])
def test_the_budget_sets_the_steps_from_the_declared_cost(algo, overrides, per_example):
    """train.compute_budget=6 (two epochs of forward and backward) over n = 256 examples at B = 32:
    1536 forward-pass equivalents, i.e. 1536 / (32 x cost) steps, whatever train.steps says."""
    cfg = compose([*BUDGET, f"algo={algo}", *overrides, "train.compute_budget=6", "train.steps=7"])
    assert algorithm_class(algo).forward_equivalents_per_example(cfg.algo, 2 if overrides and "physical" in overrides[0] else 1) \
        == per_example
    assert planned_steps(cfg, 256) == round(6 * 256 / (per_example * 32))
    assert planned_steps(compose([*BUDGET, f"algo={algo}", *overrides, "train.steps=7"]), 256) == 7  # no budget: train.steps


def test_a_budget_that_is_not_positive_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^train.compute_budget=0.0 must be positive"):
        planned_steps(compose([*BUDGET, "algo=dpsgd", "train.compute_budget=0"]), 256)


@pytest.mark.slow  # trains end to end
def test_a_run_under_a_budget_takes_the_steps_it_buys_and_records_them(tmp_path):
    """DPZero at 0.5 fwd-eq per training example (n = 256, B = 32, 2 per example): 2 steps, said in a
    note, with the budget and the passes in results.json."""
    from dpbench.logging.results import read_results
    from dpbench.run import run_job
    from helpers.config import TINY

    run_job(compose([*TINY, "algo=dpzero", "train.compute_budget=0.5"]), tmp_path, show_progress=False)
    stored = read_results(tmp_path)
    assert stored["privacy"]["steps"] == stored["privacy"]["planned_steps"] == 2
    compute = stored["compute"]
    assert compute["budget"] == 0.5 and compute["per_example"] == compute["planned_per_example"] == 2.0
    assert compute["planned_forward_equivalents"] == 2.0 * 32 * 2 and compute["backwards"] == 0
    assert any(note.startswith("train.compute_budget=0.5 forward-pass equivalents per training example: 2 steps")
               for note in stored["notes"])

"""Ghost clipping's memory over SGD, dpbench's engine against Opacus's (dpbench/tools/benchmarks/ghost_memory.py)."""

from __future__ import annotations

import pytest

from dpbench.tools.benchmarks import ghost_memory

GB = 1e9


def test_the_per_example_slope_is_the_least_squares_fit():
    assert ghost_memory.slope([8, 16, 32], [100 + 5 * b for b in (8, 16, 32)]) == pytest.approx(5)
    assert ghost_memory.slope([8, 16, 32], [10, 30, 20]) == pytest.approx(80 / 298.6666667, rel=1e-6)
    assert ghost_memory.slope([16], [7]) == 0.0


def test_the_table_names_each_batch_and_the_ratio_to_the_target():
    result = {"batches": [32, 128], "peaks": {"sgd": [1 * GB, 2 * GB], "dpbench_ghost": [1.1 * GB, 2.3 * GB],
                                              "opacus_ghost": [1.2 * GB, 2.5 * GB]},
              "excess": {"dpbench_ghost": [0.1 * GB, 0.3 * GB], "opacus_ghost": [0.2 * GB, 0.5 * GB]},
              "per_example": {"dpbench_ghost": 2e6, "opacus_ghost": 3e6}}
    table = ghost_memory.render(result, "markdown", "title")
    assert "| 128 | 2.000 | 2.300 | 2.500 | 0.300 | 0.500 | 0.43 |" in table  # 0.3 / (1.2 * 0.5 + 0.1)
    assert "dpbench 2.00 MB, Opacus 3.00 MB (ratio 0.67)" in table


@pytest.mark.slow  # four traces of BERT-base's top block (about two minutes)
def test_ghost_clipping_is_as_lean_as_opacus_on_the_write_ups_bert():
    """The issue's target on the Opacus write-up's setting (BERT-base, one trained block, T = 128),
    both engines traced on the same model and batch: dpbench's excess over SGD at most 1.2 x Opacus's
    + 0.1 GB at each B, and its bytes per example (fitted over B) at most 1.2 x Opacus's. Before the
    per-example work ran in chunks, dpbench's excess at B = 128 was 0.53 GB."""
    result = ghost_memory.run(list(ghost_memory.BERT_BLOCK), [32, 128], 128, fake=True, report=lambda line: None)
    ours, theirs = result["excess"]["dpbench_ghost"], result["excess"]["opacus_ghost"]
    assert all(o <= 1.2 * t + 0.1 * GB for o, t in zip(ours, theirs)), (ours, theirs)
    per = result["per_example"]
    assert per["dpbench_ghost"] <= 1.2 * per["opacus_ghost"], per

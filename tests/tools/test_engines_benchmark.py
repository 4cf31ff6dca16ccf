"""The engines benchmark (python -m dpbench.tools.benchmarks.engines): its table's medians and
ratios, the order its processes run in, the allocator setting of its second memory figure, and one
worker measurement on a tiny model. Nothing here is timed: the benchmark is run by hand."""

from __future__ import annotations

import pytest
import torch

from dpbench.tools.benchmarks import engines

MIB = 2**20


def run(speed, own, freed=None, tensors=None):
    return {"samples_per_s": speed, "own_peak_bytes": own * MIB, "own_peak_freed_bytes": None if freed is None else freed * MIB,
            "tensor_peak_bytes": None if tensors is None else tensors * MIB}


def test_table_gives_medians_and_ratios_to_adam_and_opacus():
    results = {
        "adam": [run(100, 500, 400, 300), run(120, 520), run(80, 480)],
        "opacus_hooks": [run(50, 1000, 800, 600), run(40, 1100), run(60, 900)],
        "dpadam:bk": [run(90, 600, 440, 330), {"error": "boom"}, run(70, 650)],
        "opacus_ghost": [{"error": "NotImplementedError: Parameter tying is not supported"}],
    }
    rows = {r["method"]: r for r in engines.table_rows(results)}
    bk = rows["dpadam:bk"]
    assert bk["speed"] == 80 and bk["own"] == 625  # medians of the runs that worked
    assert bk["speed_vs_adam"] == 0.8 and bk["speed_vs_opacus"] == 80 / 50
    assert bk["freed_vs_adam"] == 440 / 400 and bk["tensors_vs_opacus"] == 330 / 600
    assert rows["opacus_ghost"]["error"] == "NotImplementedError: Parameter tying is not supported"
    assert rows["opacus_ghost"]["speed_vs_adam"] is None
    table = engines.render(list(rows.values()), "markdown", "title")
    line = next(line for line in table.splitlines() if line.startswith("| dpadam:bk "))
    assert line.split(" | ")[1:8] == ["80.0", "0.80×", "1.60×", "625", "1.25×", "0.62×", "440"]
    assert "| opacus_ghost | error: NotImplementedError" in table


def test_methods_alternate_and_the_freed_peak_runs_once_per_method_with_the_fixed_threshold(monkeypatch):
    calls = []

    def worker(args, method, steps, warmup, env=None):
        threshold = (env or {}).get("MALLOC_MMAP_THRESHOLD_")
        calls.append((method, steps, threshold))
        return run(10.0, 200 if threshold else 300)

    monkeypatch.setattr(engines, "_worker", worker)
    args = engines.parse(["--methods", "adam,dpadam:bk,grape:bk", "--repeats", "2", "--device", "cpu", "--steps", "4"])
    results = engines.run_all(args)
    timed = [(m, s) for m, s, t in calls if t is None]
    assert timed == [("adam", 4), ("dpadam:bk", 4), ("grape:bk", 4), ("dpadam:bk", 4), ("grape:bk", 4), ("adam", 4)]
    freed = [(m, s, t) for m, s, t in calls if t is not None]
    assert freed == [(m, 1, str(engines.FIXED_MMAP_THRESHOLD)) for m in ("adam", "dpadam:bk", "grape:bk")]
    assert [r["own_peak_freed_bytes"] for r in results["adam"]] == [200 * MIB, None]
    assert [r["own_peak_bytes"] for r in results["adam"]] == [300 * MIB, 300 * MIB]


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_a_worker_measures_speed_and_both_peaks_on_a_tiny_vit(monkeypatch):
    monkeypatch.setitem(engines.SHAPES, "vit", engines.Shape("vit", width=16, depth=1, heads=2))
    for method in ("adam", "dpadam:bk"):
        result = engines.measure(method, engines.SHAPES["vit"], batch=4, steps=1, warmup=1, device=torch.device("cpu"))
        assert result["method"] == method and result["samples_per_s"] > 0
        assert 0 <= result["own_peak_bytes"] <= result["peak_bytes"] and result["memory_kind"].startswith("cpu")
        assert result["tensor_peak_bytes"] is None or result["tensor_peak_bytes"] > 0

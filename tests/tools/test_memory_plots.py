"""The DP-GRAPE Fig. 3/4-style plots (dpbench/tools/benchmarks/memory_plots.py) drawn from given
predictions: one PNG per plot, the by-rank plot reusing the default rank's curve."""

from __future__ import annotations

from dpbench.tools.benchmarks import memory_plots


def test_draw_writes_both_plots(tmp_path):
    values = {"seq_len": 128,
              "by_method": {name: {8: 5.0 + i, 40: 20.0 + i} for i, name in enumerate(memory_plots.METHODS)},
              "by_rank": {4: {8: 4.0, 40: 18.0}, 16: {8: 5.0, 40: 20.0}}}
    paths = memory_plots.draw(values, tmp_path)
    assert [p.name for p in paths] == ["roberta_memory_vs_batch_by_method.png", "roberta_memory_vs_batch_by_rank.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_the_default_rank_is_not_traced_twice(monkeypatch):
    traced = []
    monkeypatch.setattr(memory_plots, "predicted_gb", lambda extra, b, t, task: traced.append(tuple(extra)) or float(b))
    values = memory_plots.sweep([8], [4, memory_plots.DEFAULT_RANK], 128, log=lambda _: None)
    assert values["by_rank"][memory_plots.DEFAULT_RANK] == values["by_method"]["DP-GRAPE"]
    assert traced.count(("algo=grape",)) == 1 and ("algo=grape", "algo.rank=4") in traced


def test_another_model_traces_its_own_task_and_skips_an_empty_rank_plot(tmp_path, monkeypatch):
    tasks = []
    monkeypatch.setattr(memory_plots, "predicted_gb", lambda extra, b, t, task: tasks.append((tuple(task), t)) or float(b))
    values = memory_plots.sweep([1, 8], [], 256, log=lambda _: None, model="opt-6.7b")
    assert {task for task in tasks} == {(("model=opt", "model.size=6.7b", "dataset=sst2"), 256)}
    paths = memory_plots.draw(values, tmp_path)
    assert [p.name for p in paths] == ["opt_6.7b_memory_vs_batch_by_method.png"]

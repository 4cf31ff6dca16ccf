"""dpbench-report: reads results.json files, prints the table and ratios, writes the plots."""

from __future__ import annotations

from pathlib import Path

from dpbench.logging.results import write_results
from dpbench.report import load_rows, main, ratios


def fake_results(algo, batch, peak_mib, per_sample, speed, epsilon, accuracy=0.5):
    return {
        "status": "completed", "algo": algo, "model": "vit",
        "privacy": {"private": algo != "adam", "epsilon": epsilon, "target_epsilon": epsilon},
        "metrics": {"best_test_accuracy": accuracy, "test_accuracy": accuracy},
        "memory": {"peak_bytes": int(peak_mib * 2**20), "kind": "cpu_peak_rss",
                   "per_sample_grad_bytes": per_sample, "optimizer_state_bytes": 100},
        "throughput": {"samples_per_s": speed},
        "config": {"train": {"batch_size": batch}},
    }


def test_report_table_ratios_and_plots(tmp_path: Path, capsys):
    runs = [
        ("dpadam", 16, 800.0, 4000, 100.0, 8.0), ("dpadam", 32, 1000.0, 8000, 110.0, 8.0),
        ("grape", 16, 700.0, 1000, 120.0, 8.0), ("grape", 32, 750.0, 2000, 132.0, 8.0),
        ("grape", 32, 750.0, 2000, 132.0, 2.0), ("adam", 32, 650.0, 0, 400.0, None),
    ]
    for i, run in enumerate(runs):
        write_results(tmp_path / f"job{i}", fake_results(*run))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    rows = load_rows(tmp_path)
    assert len(rows) == 6
    at16 = next(r for r in ratios(rows) if r["batch_size"] == 16)
    assert abs(at16["peak_mib"] - 700 / 800) < 1e-9
    assert abs(at16["per_sample_grad_bytes"] - 0.25) < 1e-9
    assert abs(at16["samples_per_s"] - 1.2) < 1e-9
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "grape/dpadam at batch 16" in out and "dpadam" in out
    assert (tmp_path / "memory_vs_batch.png").stat().st_size > 1000
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 1000  # grape ran at two epsilons


def test_report_on_empty_folder_fails_with_a_message(tmp_path: Path, capsys):
    assert main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "no results.json" in captured.out + captured.err

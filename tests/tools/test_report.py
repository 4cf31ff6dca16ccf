"""dpbench-report: reads results.json files, prints the table and ratios, writes the plots."""

from __future__ import annotations

from pathlib import Path

from dpbench.logging.results import write_results
from dpbench.tools.report import load_rows, main, ratios


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
    at16 = next(r for r in ratios(rows) if r.batch_size == 16)
    assert abs(at16.peak_mib - 700 / 800) < 1e-9
    assert abs(at16.per_sample_grad_bytes - 0.25) < 1e-9
    assert abs(at16.samples_per_s - 1.2) < 1e-9
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


def language_results(algo, seed, accuracy, *, steps=1000, epsilon=6.0, dataset="sst2", best=None, sampling="poisson",
                     accountant="rdp", report=None):
    """A results.json as run.py writes it today (config stored resolved, with the report block)."""
    private = algo != "adam"
    config = {
        "seed": seed, "name": "t3", "device": "auto",
        "algo": {"name": algo, "rank": 16},
        "model": {"name": "roberta", "size": "large"},
        "dataset": {"name": dataset, "data_seed": seed},
        "privacy": {"epsilon": epsilon, "clip_norm": 0.5, "clipping": "flat", "sampling": sampling},
        "train": {"batch_size": 64, "steps": steps, "lr": 1e-4},
        "report": report if report is not None else {"paper": "dpgrape", "table": "T3", "metric": "final", "expect": []},
    }
    return {
        "status": "completed", "algo": algo, "model": "roberta", "dataset": dataset, "seed": seed,
        "privacy": {"private": private, "epsilon": epsilon - 0.005 if private else None,
                    "target_epsilon": epsilon if private else None, "steps": steps, "planned_steps": steps,
                    "accountant": accountant if private else None, "sampling": sampling},
        "metrics": {"metric": "accuracy", "test_accuracy": accuracy, "best_test_accuracy": best or accuracy + 0.01},
        "memory": {"peak_bytes": 2**30, "start_bytes": 2**29, "kind": "cuda_max_reserved"},
        "throughput": {"samples_per_s": 70.0}, "versions": {"device": "NVIDIA H100"},
        "config": config,
    }


def test_seeds_are_averaged_with_standard_error_beside_the_paper(tmp_path: Path, capsys):
    for seed, acc in zip((13, 21, 42), (0.92, 0.93, 0.94)):
        write_results(tmp_path / f"grape-{seed}", language_results("grape", seed, acc))
    write_results(tmp_path / "adam", language_results("adam", 13, 0.95))
    assert main([str(tmp_path), "--format", "csv", "--no-plots"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(",")[2]: line.split(",") for line in out.splitlines() if line.startswith("sst2")}
    grape = rows["grape"]
    assert grape[6] == "3" and grape[7] == "1000"                  # seeds, steps
    assert grape[8] == "93.0 ± 0.6"                                  # mean ± SE = 0.01/sqrt(3)*100
    assert grape[12] == "93.3 ± 0.4" and grape[13] == "-0.3"         # DP-GRAPE ε=6 SST-2 in Table 3, and Δ
    assert rows["adam"][4] == rows["adam"][5] == "∞" and rows["adam"][12] == "93.1 ± 0.3"  # AdamW row


def test_runs_that_differ_only_in_keys_that_supply_defaults_are_averaged(tmp_path: Path, capsys):
    """A seed run after an algorithm gained default_lr (or a preset relabelled its source line) is
    the same computation: its train.lr landed where it did before."""
    older = language_results("grape", 13, 0.92)
    newer = language_results("grape", 21, 0.94)
    newer["config"]["algo"].update(default_lr=0.02, lr_family="adam", default_clip_norm=1.0, default_steps=None)
    newer["config"]["paper_setting"] = {"source": {"grape": "relabelled"}}
    newer["config"]["algo"]["mode"] = "full"  # a key added since, at the value runs before it had (PREDATING_VALUES)
    write_results(tmp_path / "older", older)
    write_results(tmp_path / "newer", newer)
    assert main([str(tmp_path), "--format", "csv", "--no-plots"]) == 0
    grape = [line.split(",") for line in capsys.readouterr().out.splitlines() if line.startswith("sst2")]
    assert len(grape) == 1 and grape[0][6] == "2" and grape[0][8] == "93.0 ± 1.0"


def test_runs_of_different_lengths_are_never_averaged_and_the_key_is_named(tmp_path: Path, capsys):
    write_results(tmp_path / "a", language_results("grape", 13, 0.90, steps=168))
    write_results(tmp_path / "b", language_results("grape", 21, 0.80, steps=30))
    assert main([str(tmp_path), "--format", "markdown", "--no-plots"]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert out.count("| sst2 | roberta-large | grape |") == 2
    assert "not averaged" in out and "train.steps (168 vs 30)" in out.replace("\n", " ")


def test_best_metric_flags_latex_and_old_files(tmp_path: Path, capsys):
    write_results(tmp_path / "a", language_results("grape", 13, 0.90, best=0.97, sampling="shuffle", accountant="gdp"))
    old = {"algo": "dpadam", "model": "vit", "privacy": {"epsilon": 3.0}, "metrics": {"best_test_accuracy": 0.5}}
    write_results(tmp_path / "old", old)                                  # no config, no report, no schema_version
    assert main([str(tmp_path), "--metric", "best", "--format", "latex", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert r"\begin{tabular}" in out and "97.0" in out and "50.0" in out
    assert "shuffle-sampled" in out and "approximate accountant" in out


def test_check_without_expectations_or_with_a_bad_one_is_an_error(tmp_path: Path):
    write_results(tmp_path / "a", language_results("grape", 13, 0.9))
    assert main([str(tmp_path), "--check", "--no-plots"]) == 1          # nothing stated: nothing passes
    report = {"paper": "dpgrape", "table": "T3", "metric": "final", "expect": ["__import__('os')"]}
    write_results(tmp_path / "a", language_results("grape", 13, 0.9, report=report))
    assert main([str(tmp_path), "--check", "--no-plots"]) == 2          # only names, numbers, arithmetic, comparisons


def test_accuracy_plot_has_error_bars_and_a_non_private_line(tmp_path: Path):
    for eps in (2.0, 6.0):
        for seed, acc in ((13, 0.8), (21, 0.9)):
            write_results(tmp_path / f"g{eps}{seed}", language_results("grape", seed, acc + eps / 100, epsilon=eps))
    write_results(tmp_path / "adam", language_results("adam", 13, 0.95))
    assert main([str(tmp_path), "--no-plots"]) == 0 and not (tmp_path / "accuracy_vs_epsilon.png").exists()
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 1000
    assert not (tmp_path / "memory_vs_batch.png").exists()               # one batch size: no memory curve


def test_runs_whose_epsilon_is_not_a_proven_bound_are_flagged():
    """DC-DPSGD's paper-accounting row (tail_clip) notes that its ε is not a proven bound; the
    report flags it beside the sound rows. A shuffled run of schema 4 has a proven bound."""
    from dpbench.logging.results import RunResults
    from dpbench.tools.report.load import unproven_bound

    paper = RunResults.from_json({"status": "completed", "notes": [
        "algo.gradient_sensitivity=tail_clip: the paper's model, not a proven bound"]})
    sound = RunResults.from_json({"status": "completed", "notes": ["privacy.log_private_stats=true: ..."]})
    assert unproven_bound(paper) and not unproven_bound(sound)


def test_rows_whose_hyperparameters_were_picked_on_test_are_flagged():
    """A preset that declares report.selected_on=test (bench_mini: lrs picked on seed 0's test
    accuracy) is flagged "selected on test"; one picked on validation data is not."""
    from dpbench.api import compose
    from dpbench.tools.report.groups import Group
    from dpbench.tools.report.load import RunRow
    from dpbench.tools.report.tables import flags

    assert compose(["experiment=bench_mini", "algo=dpsgd"]).report.selected_on == "test"
    on_test = RunRow(path="a", report={"selected_on": "test"})
    on_validation = RunRow(path="b", report={"selected_on": "validation"})
    assert "selected on test" in flags(Group([on_test], ()))
    assert "selected on test" not in flags(Group([on_validation], ()))


def test_the_noisy_validation_score_is_a_column_only_when_a_run_has_one(tmp_path: Path):
    from dpbench.tools.report.groups import group_runs
    from dpbench.tools.report.tables import build_table

    with_split = fake_results("dpsgd", 32, 500.0, 10, 100.0, 3.0, accuracy=0.6)
    with_split["metrics"]["validation_score"] = 0.5731
    write_results(tmp_path / "validated" / "a", with_split)
    write_results(tmp_path / "plain" / "a", fake_results("dpsgd", 32, 500.0, 10, 100.0, 3.0, accuracy=0.6))
    header, body = build_table(group_runs(load_rows(tmp_path / "validated"))[0], "final", None)
    assert "validation % (noisy)" in header and body[0][header.index("validation % (noisy)")] == "57.3"
    header, _ = build_table(group_runs(load_rows(tmp_path / "plain"))[0], "final", None)
    assert "validation % (noisy)" not in header


def test_the_table_shows_own_and_process_peaks_and_on_request_a_predicted_gpu_peak(tmp_path: Path, capsys):
    """--predict-gpu traces each group's first run from the overrides its folder keeps; a run
    without them keeps its measured figures and gets a note (docs/memory-prediction.md)."""
    from dpbench.tools.report.tables import build_table

    traced, untraced = tmp_path / "traced", tmp_path / "untraced"
    write_results(traced, {**fake_results("dpsgd", 8, 900.0, 0, 50.0, 8.0), "memory": {
        "peak_bytes": 900 * 2**20, "start_bytes": 600 * 2**20, "kind": "cpu_peak_rss"}})
    (traced / ".hydra").mkdir()
    (traced / ".hydra" / "overrides.yaml").write_text(
        "- dataset=synthetic\n- model=cnn\n- algo=dpsgd\n- train.batch_size=256\n")
    write_results(untraced, fake_results("grape", 8, 700.0, 0, 50.0, 8.0))
    assert main([str(tmp_path), "--predict-gpu", "--no-plots", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    header, *rows = [line.split(",") for line in captured.out.strip().splitlines()]
    own, process, predicted = (header.index(name) for name in ("own peak MiB", "process peak MiB", "predicted GPU peak MiB"))
    by_algo = {row[header.index("algo")]: row for row in rows}
    assert by_algo["dpsgd"][own] == "300" and by_algo["dpsgd"][process] == "900"
    # the default CNN's step at B = 256: its per-example gradients alone are tens of MiB
    assert 10 < float(by_algo["dpsgd"][predicted]) < 2000
    assert by_algo["grape"][predicted] == "—" and "no .hydra/overrides.yaml" in captured.err + captured.out
    # without the flag there is no such column
    header, _ = build_table([], "final", None)
    assert "predicted GPU peak MiB" not in header and "own peak MiB" in header


def test_predict_gpu_with_the_leaderboard_is_refused_in_one_line(tmp_path: Path, capsys):
    write_results(tmp_path / "run", fake_results("grape", 8, 700.0, 0, 50.0, 8.0))
    assert main([str(tmp_path), "--leaderboard", "--predict-gpu", "--no-plots"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1 and "--predict-gpu" in lines[0] and "leaderboard" in lines[0]

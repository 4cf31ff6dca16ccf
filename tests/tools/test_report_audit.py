"""dpbench-report and audit.json: a run's row gains the one-run audit's lower bound on ε and its
ceiling, folders with an audit.json only get a "Privacy audits" table, and a folder without any
audit.json renders as before. The audit.json files are written by AuditReport / OneRunReport."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from dpbench.logging.results import write_results
from dpbench.tools.audit.report import AuditReport, Check
from dpbench.tools.audit.one_run import OneRunReport, OneRunResult
from dpbench.tools.report import group_runs, main
from dpbench.tools.report.html import page
from dpbench.tools.report.leaderboard import build_boards, fairness
from dpbench.tools.report.load import load_report, load_rows
from dpbench.tools.report.tables import build_audit_table, build_table


def results(algo: str, seed: int, accuracy: float, epsilon: float = 2.0) -> dict:
    """A results.json as run.py writes it (as tests/tools/test_report.py builds them)."""
    private = algo != "adam"
    config = {
        "seed": seed, "name": "audited", "device": "auto",
        "algo": {"name": algo}, "model": {"name": "cnn"}, "dataset": {"name": "mnist", "data_seed": seed},
        "privacy": {"epsilon": epsilon, "clip_norm": 1.0, "clipping": "flat", "sampling": "poisson"},
        "train": {"batch_size": 64, "steps": 100, "lr": 1e-3},
        "report": {"metric": "final", "expect": []},
    }
    return {
        "status": "completed", "algo": algo, "model": "cnn", "dataset": "mnist", "seed": seed,
        "privacy": {"private": private, "epsilon": epsilon - 0.01 if private else None,
                    "target_epsilon": epsilon if private else None, "steps": 100, "planned_steps": 100,
                    "accountant": "rdp" if private else None, "sampling": "poisson"},
        "metrics": {"metric": "accuracy", "test_accuracy": accuracy, "best_test_accuracy": accuracy},
        "memory": {"peak_bytes": 2**28, "start_bytes": 2**27, "kind": "cpu_peak_rss"},
        "throughput": {"samples_per_s": 500.0}, "config": config,
    }


def one_run_json(bound: float, claimed: float = 1.99, correct: int = 431, **extra) -> dict:
    """audit.json of a one-run canary audit (OneRunReport.to_json), plus any newer keys."""
    figures = dict(claimed_epsilon=claimed, epsilon_lower_bound=bound, ceiling=5.56, canaries=1000, guesses=800,
                   correct=correct, confidence=0.95, delta=1e-5, included=497, steps=100, noise_multiplier=1.1,
                   sample_rate=0.01, clip_norm=1.0)
    # OneRunResult grows keys (the report reads the ones above, the rest are optional): zero for a new required one
    names = {f.name: f for f in fields(OneRunResult)}
    figures = {name: figures.get(name, 0) for name, f in names.items()
               if name in figures or (f.default is MISSING and f.default_factory is MISSING)}
    result = OneRunResult(**figures)
    check = Check("one_run", "1000 gradient canaries", bound, claimed, bound <= claimed, "eps lower bound ...")
    data = OneRunReport("dpsgd", "cnn", "mnist", [check], result).to_json()
    data["one_run"].update(extra)
    return data


def checks_json(failing: tuple[str, ...] = ()) -> dict:
    """audit.json of the self-audit (AuditReport.to_json): checks only, no one_run key."""
    names = ("noise", "independence", "sensitivity", "sampler", "accounting")
    checks = [Check(name, "noisy sum", 1.0, 2.0, name not in failing, "...") for name in names]
    return AuditReport("grape", "vit", "cifar10", checks).to_json()


def write_audit(folder: Path, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "audit.json").write_text(json.dumps(data, indent=2))


def csv_tables(text: str) -> list[list[list[str]]]:
    """The csv output's tables (a blank line between them), each a list of rows."""
    import csv
    import io

    return [list(csv.reader(io.StringIO(block))) for block in text.strip().split("\n\n") if block.strip()]


def test_an_audited_run_shows_its_lower_bound_and_ceiling_beside_epsilon(tmp_path: Path, capsys):
    write_results(tmp_path / "dpsgd-13", results("dpsgd", 13, 0.90))
    write_audit(tmp_path / "dpsgd-13", one_run_json(0.27, epsilon_lower_bound_release=0.31))  # a newer key: ignored
    write_results(tmp_path / "adam", results("adam", 13, 0.95))

    rows, audits = load_report(tmp_path)
    audited = next(r for r in rows if r.algo == "dpsgd")
    assert audited.audit_epsilon_lower_bound == pytest.approx(0.27) and audited.audit_ceiling == pytest.approx(5.56)
    assert audited.audit_claimed_epsilon == pytest.approx(1.99) and audited.audit_passed is True
    assert next(r for r in rows if r.algo == "adam").audit_passed is None
    assert [a.path for a in audits] == ["dpsgd-13"] and audits[0].with_results

    assert main([str(tmp_path), "--format", "csv", "--no-plots"]) == 0
    runs, audit_table = csv_tables(capsys.readouterr().out)
    header = runs[0]
    assert header[5:8] == ["ε spent", "audit ε≥", "ceiling"]
    by_algo = {row[2]: row for row in runs[1:]}
    assert by_algo["dpsgd"][5:8] == ["1.99", "0.27", "5.56"]
    assert by_algo["adam"][5:8] == ["∞", "—", "—"]
    assert audit_table[0][:2] == ["folder", "algo"] and "ε lower bound" in audit_table[0]
    assert audit_table[1] == ["dpsgd-13", "dpsgd", "cnn", "mnist", "1.99", "0.27", "5.56", "1000", "431/800", "passed"]


def test_the_seeds_of_a_group_show_the_range_of_their_bounds(tmp_path: Path):
    for seed, bound in ((13, 0.20), (21, 0.27), (42, None)):  # the third seed was not audited
        write_results(tmp_path / f"s{seed}", results("dpsgd", seed, 0.9))
        if bound is not None:
            write_audit(tmp_path / f"s{seed}", one_run_json(bound))
    groups, _ = group_runs(load_rows(tmp_path))
    header, body = build_table(groups, "final", None)
    (row,) = body
    assert row[header.index("audit ε≥")] == "0.20 – 0.27" and row[header.index("ceiling")] == "5.56"
    assert row[header.index("seeds")] == "3"


def test_a_bound_above_the_claim_fails_and_is_flagged(tmp_path: Path, capsys):
    write_results(tmp_path / "broken-noise", results("dpsgd", 13, 0.90))
    write_audit(tmp_path / "broken-noise", one_run_json(4.80, correct=790))
    assert main([str(tmp_path), "--format", "markdown", "--no-plots"]) == 0
    out = capsys.readouterr().out
    main_table = next(line for line in out.splitlines() if line.startswith("| mnist |"))
    assert "| 4.80 | 5.56 |" in main_table and "audit FAILED: one_run" in main_table
    assert "**Privacy audits" in out and "| 790/800 | FAILED: one_run |" in out


def test_audit_only_folders_get_their_own_table_and_a_broken_file_is_skipped(tmp_path: Path, capsys):
    write_audit(tmp_path / "one_run", one_run_json(0.27))
    write_audit(tmp_path / "self_audit_ok", checks_json())
    write_audit(tmp_path / "self_audit_bad", checks_json(failing=("noise", "accounting")))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "audit.json").write_text("{not json")
    (tmp_path / "not_an_object").mkdir()
    (tmp_path / "not_an_object" / "audit.json").write_text("[1, 2]")

    rows, audits = load_report(tmp_path)
    assert rows == [] and [a.path for a in audits] == ["one_run", "self_audit_bad", "self_audit_ok"]
    header, body = build_audit_table(audits)
    cells = {row[0]: dict(zip(header, row)) for row in body}
    assert cells["one_run"]["claimed ε"] == "1.99" and cells["one_run"]["ε lower bound"] == "0.27"
    assert cells["one_run"]["ceiling"] == "5.56" and cells["one_run"]["correct / guesses"] == "431/800"
    assert cells["self_audit_ok"]["verdict"] == "passed (5 checks)" and cells["self_audit_ok"]["ε lower bound"] == "—"
    assert cells["self_audit_bad"]["verdict"] == "FAILED (2 of 5 checks): noise, accounting"

    assert main([str(tmp_path), "--no-plots"]) == 0  # the rich console table
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "Privacy audits" in out and "431/800" in out and "5.56" in out
    assert "FAILED (2 of" in out and "accounting" in out
    assert "skipping" in out and "broken" in out and "not_an_object" in out
    assert not (tmp_path / "accuracy_vs_epsilon.png").exists()
    assert main([str(tmp_path), "--leaderboard", "--format", "html"]) == 2  # a leaderboard needs runs


def test_a_folder_without_audit_json_renders_as_before(tmp_path: Path, capsys):
    write_results(tmp_path / "dpsgd", results("dpsgd", 13, 0.90))
    write_results(tmp_path / "adam", results("adam", 13, 0.95))
    rows, audits = load_report(tmp_path)
    assert audits == [] and all(r.audit_passed is None for r in rows)
    header, body = build_table(group_runs(rows)[0], "final", None)
    assert "audit ε≥" not in header and "ceiling" not in header and all(len(row) == len(header) for row in body)
    assert main([str(tmp_path), "--format", "csv", "--no-plots"]) == 0
    (runs,) = csv_tables(capsys.readouterr().out)
    assert runs[0] == header
    assert main([str(tmp_path), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert "Privacy audits" not in captured.out + captured.err and "audit" not in captured.out


def test_empty_folder_still_fails_with_a_message(tmp_path: Path, capsys):
    assert main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "no results.json" in captured.out + captured.err


def test_the_html_leaderboard_has_a_privacy_audits_section(tmp_path: Path):
    write_results(tmp_path / "dpsgd", results("dpsgd", 13, 0.90))
    write_audit(tmp_path / "dpsgd", one_run_json(0.27))
    write_audit(tmp_path / "self_audit", checks_json(failing=("sampler",)))
    rows, audits = load_report(tmp_path)
    boards = build_boards(group_runs(rows)[0], "final")
    text = page(boards, fairness(boards), {}, "leaderboard", audits)
    assert '<h2 id="audits">Privacy audits</h2>' in text
    assert '<td class="num">0.27</td><td class="num">5.56</td>' in text and "431/800" in text
    assert '<tr class="failed">' in text and "FAILED (1 of 5 checks): sampler" in text
    assert "Privacy audits" not in page(boards, fairness(boards), {}, "leaderboard")  # nothing audited: no section

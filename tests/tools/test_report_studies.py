"""`dpbench-report --leaderboard` over private studies (dpbench/tools/report/studies.py): methods
ranked by the mean test accuracy of their studies' selected models, each study's epsilon and the
epsilon of a method's studies composed, and the rank each method had under paper hyperparameters."""

import json
import math

import pytest

from dpbench import study
from dpbench.study import publish
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.tools.report import studies as board_module
from dpbench.tools.report.studies import StudyEntry, StudyRow, build_study_boards, study_board_table

DELTA = 1e-5


def _ledger_records(sigma=1.0, q=0.2, steps=10, score_sigma=12.0):
    ledger = Ledger()
    ledger.add(GaussianMechanism(sigma, q, "add_remove"), steps)
    ledger.add_release(GaussianMechanism(score_sigma, 1.0, "add_remove"))
    return ledger.as_records()


def _row(method, accuracy, path=None, dataset="digits", eps=3.0):
    return StudyRow(path=path or f"{method}/{accuracy}", method=method, dataset=dataset, model="vit-micro",
                    budget_epsilon=eps, epsilon_study=2.99, delta=DELTA, mean_trials=4.0, shape=1.0,
                    test_accuracy=accuracy, validation=accuracy - 1 if accuracy is not None else None,
                    ledger=_ledger_records())


def test_methods_rank_by_the_mean_test_accuracy_of_their_selected_models():
    rows = [_row("grape", 70.0), _row("grape", 74.0), _row("dpadam", 60.0), _row("dpadam", 84.0), _row("dpsgd", 50.0)]
    (board,) = build_study_boards(rows)
    assert [(e.method, e.rank) for e in board.entries] == [("dpadam", 1), ("grape", 1), ("dpsgd", 3)]  # a tie shares
    grape = board.entries[1]
    assert grape.accuracy == 72.0 and grape.accuracy_se == pytest.approx(math.sqrt(8) / math.sqrt(2))
    header, body = study_board_table(board)
    assert body[1][:4] == ["1", "grape", "72.0 ± 2.0", "2"]
    assert not any("trials" in h and "mean" not in h for h in header)  # the realised K is never a column


def test_a_methods_studies_together_cost_their_composition():
    entry = StudyEntry("grape", [_row("grape", 70.0), _row("grape", 72.0), _row("grape", 71.0)])
    event = study.trial_event(Ledger.from_records(_ledger_records()))
    one = study.study_epsilon(event, 4.0, 1.0, DELTA)
    assert entry.epsilon_all == pytest.approx(study.study_epsilon(event, 4.0, 1.0, DELTA, studies=3))
    assert one < entry.epsilon_all < 3 * one


def test_rank_changes_against_the_paper_hyperparameter_board(monkeypatch):
    paper = {("digits", "vit-micro", 3.0): {"dpadam": 64.0, "dpadam_bk": 61.0, "grape": 55.0, "dpsgd": 50.0, "adam_x": 99.0}}
    monkeypatch.setattr(board_module, "_paper_ranks", lambda folder, metric: paper)
    rows = [_row("grape", 70.0), _row("dpadam", 65.0), _row("dpsgd", 50.0)]
    (board,) = build_study_boards(rows, compare_with="somewhere")
    changes = {e.method: (e.rank, e.paper_rank, board_module._change(e)) for e in board.entries}
    # paper ranks among the methods shown (dpadam_bk is an engine the tuned board does not carry)
    assert changes == {"grape": (1, 2, "↑1"), "dpadam": (2, 1, "↓1"), "dpsgd": (3, 3, "=")}


def test_a_study_that_released_nothing_joins_its_task_and_is_left_out_of_the_mean():
    empty = _row("dpdr", None, dataset=None)
    empty.model = None
    rows = [_row("dpdr", 40.0), empty, _row("grape", 50.0)]
    (board,) = build_study_boards(rows)
    dpdr = next(e for e in board.entries if e.method == "dpdr")
    assert len(dpdr.studies) == 2 and dpdr.accuracy == 40.0
    assert any("released no model" in line for line in board_module.study_notes([board]))


def test_load_studies_reads_the_selected_trials_run(tmp_path):
    """study.json and the selected trial's results.json, as the sweeper and a trial write them."""
    from helpers.config import TINY

    from dpbench.api import run

    trial = tmp_path / "algo-dpsgd" / publish.SELECTED_DIR
    run([*TINY, "algo=dpsgd", "privacy.noise_multiplier=1.0", "dataset.validation_fraction=0.2",
         "train.evaluate_test=false", "train.eval_every=0"], run_dir=trial, show_progress=False)
    # the publishable file alone: no K, no outcomes (a private area beside it is never read)
    summary = {"schema": publish.STUDY_SCHEMA, "study_id": "x", "epsilon_study": 2.5, "delta": DELTA, "mean_trials": 4,
               "shape": 1, "budget_epsilon": 3.0,
               "selected": {"run_dir": publish.SELECTED_DIR, "validation_score": 0.4,
                            "test": {"metric": "accuracy", "accuracy": 0.5}, "overrides": []}}
    (tmp_path / "algo-dpsgd" / "study.json").write_text(json.dumps(summary))
    (tmp_path / "algo-dpsgd" / publish.PRIVATE_DIR).mkdir()
    (tmp_path / "algo-dpsgd" / publish.PRIVATE_DIR / "study.json").write_text("not read")
    (row,) = board_module.load_studies(tmp_path)
    assert (row.method, row.dataset, row.test_accuracy, row.validation) == ("dpsgd", "synthetic", 50.0, 40.0)
    assert any(r["sample_rate"] == 1.0 and r["count"] == 1 for r in row.ledger)  # the noisy score is charged


def test_a_study_that_selected_nothing_is_named_from_its_study_json(tmp_path):
    summary = {"schema": publish.STUDY_SCHEMA, "study_id": "y", "epsilon_study": 2.5, "delta": DELTA, "mean_trials": 4,
               "shape": "inf", "budget_epsilon": 3.0, "selected": None, "task": {"algo": None, "dataset": "digits"},
               "fixed_overrides": ["algo=dpdr", "seed=0"]}
    (tmp_path / "study.json").write_text(json.dumps(summary))
    (row,) = board_module.load_studies(tmp_path)
    assert (row.method, row.dataset, row.test_accuracy) == ("dpdr", "digits", None)


def test_the_tuned_vs_paper_figure_needs_the_paper_board(tmp_path, monkeypatch):
    rows = [_row("grape", 70.0), _row("dpadam", 65.0)]
    (alone,) = build_study_boards(rows)
    assert board_module.plot_tuned_vs_paper(alone, tmp_path / "none.png") is None
    monkeypatch.setattr(board_module, "_paper_ranks", lambda folder, metric: {("digits", "vit-micro", 3.0): {"grape": 55.0}})
    (board,) = build_study_boards(rows, compare_with="somewhere")
    assert [e.paper_accuracy for e in board.entries] == [55.0, None]
    made = board_module.plot_tuned_vs_paper(board, tmp_path / "tuned.png")
    assert made.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kendalls_tau_between_the_tuned_and_the_paper_rankings(monkeypatch):
    paper = {("digits", "vit-micro", 3.0): {"dpadam": 64.0, "grape": 55.0, "dpsgd": 50.0}}
    monkeypatch.setattr(board_module, "_paper_ranks", lambda folder, metric: paper)
    rows = [_row("grape", 70.0), _row("dpadam", 65.0), _row("dpsgd", 50.0)]
    boards = build_study_boards(rows, compare_with="somewhere")
    (line,) = [line for line in board_module.study_notes(boards) if "Kendall" in line]
    assert "Kendall's τ = 0.33 over 3 methods" in line  # one of the three pairs swapped: (2 - 1) / 3

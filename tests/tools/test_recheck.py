"""results.json's ledger as dp-accounting events, and `dpbench-report --recheck` recomputing epsilon
from the file alone for a run of each accountant."""

from __future__ import annotations

import pytest

from dpbench.logging.results import PrivacyResults, RunResults, write_results
from dpbench.privacy.accountants import PLDAccountant, build_accountant
from dpbench.privacy.events import event_from_json, event_to_json, events_record, ledger_dp_event
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.tools.report.cli import main as report

DELTA = 1e-5


def run_ledger(neighboring: str = "add_remove") -> Ledger:
    ledger = Ledger()
    ledger.add(GaussianMechanism(1.0, 0.05, neighboring), 100)
    ledger.add(GaussianMechanism(10.0, 1.0, neighboring), 1)  # a validation score
    return ledger


def test_events_round_trip_through_json_and_dp_accounting():
    import dp_accounting as dpa

    ledger = run_ledger()
    record = events_record([ledger])
    assert record["neighboring_relation"] == "ADD_OR_REMOVE_ONE" and record["composition"] == "sequential"
    event = event_from_json(record["events"][0])
    assert event == ledger_dp_event(ledger) and event_to_json(event) == record["events"][0]
    theirs = dpa.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(DELTA)
    assert PLDAccountant(1e-3).epsilon(ledger, DELTA) == pytest.approx(theirs, rel=1e-9)


def test_a_replace_one_ledger_is_recorded_under_replace_one_with_its_own_sigma():
    record = events_record([run_ledger("replace_one")])
    assert record["neighboring_relation"] == "REPLACE_ONE"
    assert event_from_json(record["events"][0]) == ledger_dp_event(run_ledger("replace_one"), exact_replace_one=True)


def test_events_refuse_what_is_not_dp_accounting():
    with pytest.raises(ValueError, match="not a dp_accounting event"):
        event_from_json({"module_name": "os", "class_name": "system", "command": "true"})


def one_mechanism_ledger() -> Ledger:  # gdp composes one (sigma, q) only
    ledger = Ledger()
    ledger.add(GaussianMechanism(1.0, 0.05), 100)
    return ledger


def write_run(folder, accountant: str, ledger_only: bool = False, ledger: Ledger | None = None):
    ledger = ledger or one_mechanism_ledger()
    chosen = build_accountant(accountant)
    epsilon = chosen.epsilon(ledger, DELTA)
    lower, upper = chosen.bounds(ledger, DELTA)
    privacy = PrivacyResults(private=True, epsilon=epsilon, delta=DELTA, accountant=accountant, ledger=ledger.as_records(),
                             epsilon_lower=lower, epsilon_upper=upper,
                             dp_events=None if ledger_only else events_record([ledger]))
    write_results(folder, RunResults(status="completed", privacy=privacy))
    return epsilon, lower, upper


@pytest.mark.slow  # dp-accounting's PLD at three intervals and its optimistic estimate: seconds per run
@pytest.mark.parametrize("accountant", ["pld", "prv", "rdp", "gdp"])
def test_recheck_reproduces_each_accountants_epsilon(accountant, tmp_path, capsys):
    epsilon, lower, upper = write_run(tmp_path, accountant)
    status = report([str(tmp_path), "--recheck"])
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert f"recorded epsilon {epsilon:.4f} by {accountant}" in out and "dp-accounting from dp_events" in out
    tight = PLDAccountant().epsilon(one_mechanism_ledger(), DELTA)
    assert "PLD lower" in out and f"upper {tight:.4f}" in out
    if accountant == "gdp":  # the approximation is below the tight bound here: flagged
        assert epsilon < tight * 0.99 and lower is None and upper is None
        assert status == 1 and "BELOW" in out
    else:
        assert status == 0 and "consistent" in out and upper == epsilon
        assert (lower is None) == (accountant == "rdp") and (lower is None or lower <= tight <= upper)


def test_recheck_reads_an_older_file_from_its_ledger(tmp_path, capsys):
    one_release = Ledger()
    one_release.add(GaussianMechanism(5.0, 1.0))  # a full-batch Gaussian: dp-accounting answers in milliseconds
    write_run(tmp_path, "rdp", ledger_only=True, ledger=one_release)
    assert report([str(tmp_path), "--recheck"]) == 0
    captured = capsys.readouterr()
    assert "dp-accounting from ledger" in captured.out + captured.err


def test_recheck_of_a_folder_without_runs_is_one_line(tmp_path, capsys):
    assert report([str(tmp_path), "--recheck"]) == 2
    captured = capsys.readouterr()
    assert "no results.json" in captured.out + captured.err


def test_recheck_of_a_near_noiseless_run_never_builds_a_grid_too_large(tmp_path, capsys, monkeypatch):
    """The one-run audit's loud runs (sigma 0.02) need PLD grids the OOM killer ends the process
    for: with no grid fitting (the cap lowered to stand for them), the recorded epsilon (pld's rdp
    fallback, an upper bound) is shown beside dp-accounting's RDP, unchecked, and no PLD is built."""
    from dp_accounting.pld import privacy_loss_distribution

    from dpbench.privacy import accountants

    one_release = Ledger()
    one_release.add(GaussianMechanism(5.0, 1.0))
    monkeypatch.setattr(accountants, "MAX_PLD_POINTS", 10)
    epsilon, lower, upper = write_run(tmp_path, "pld", ledger=one_release)
    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", None)  # any PLD built fails
    assert report([str(tmp_path), "--recheck"]) == 0
    out = " ".join(capsys.readouterr().err.split())
    assert lower is None and upper == epsilon
    assert f"recorded epsilon {epsilon:.4f} by pld" in out and "PLD lower -, upper -, RDP" in out
    assert "not re-checked by PLD (no grid fits in memory)" in out

"""dpbench-audit's console table reads at a glance: one verdict per check, the reason only where a
check failed, every detail in audit.json."""

from __future__ import annotations

from rich.console import Console

from dpbench.tools.audit.report import AuditReport, Check
from dpbench.tools.audit.runner import audit_table, check_verdict


def rendered(report: AuditReport) -> str:
    console = Console(width=160, record=True)
    console.print(audit_table(report))
    return console.export_text()


def test_passing_checks_show_a_verdict_and_no_detail():
    noise = Check("noise", "clipped sum", 0.9, 1.0, True, "LONG DETAIL " * 20, 0.4)
    missing = Check("validation score", "validation score", 0, 0, True, "not applicable: no validation split")
    text = rendered(AuditReport("dpsgd", "vit", "digits", [noise, missing]))
    assert "LONG DETAIL" not in text and "why" not in text and "audit.json" in text
    assert [check_verdict(c) for c in (noise, missing)] == ["pass", "n/a"]


def test_a_failed_check_says_why():
    broken = Check("sensitivity", "clipped sum", 1.3, 1.0, False, "the sum moved by 1.3 C")
    text = rendered(AuditReport("dpsgd", "vit", "digits", [broken]))
    assert "FAIL" in text and "the sum moved by 1.3 C" in text


def test_a_one_run_bound_is_consistent_or_refutes_never_confirms():
    below = Check("one_run", "1000 gradient canaries", 0.2, 2.0, True, "bound")
    above = Check("one_run", "1000 gradient canaries", 3.1, 2.0, False, "bound above the claim")
    text = rendered(AuditReport("dpsgd", "cnn", "mnist", [below]))
    assert "0.2 ≤ 2" in text and "consistent" in text and "not confirm" in text
    assert check_verdict(above) == "REFUTED" and "3.1 > 2" in rendered(AuditReport("dpsgd", "cnn", "mnist", [above]))

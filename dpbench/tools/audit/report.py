"""What an audit found: one row per check, and the report `dpbench-audit` prints and writes as
audit.json (`dpbench/tools/audit/runner.py` runs the self-check, `dpbench/tools/audit/one_run.py` the one-run
canary audit; both report in these terms)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    name: str  # one of CHECK_ORDER
    release: str  # which release (or ledger) it is about
    measured: float
    bound: float
    passed: bool
    detail: str
    # a statistical check's p-value (None: deterministic); `family_corrected` sets its verdict
    p_value: float | None = None


def family_corrected(checks: list[Check], alpha: float) -> list[Check]:
    """Bonferroni over the audit's statistical checks: each of the k passes when its p-value is
    above alpha / k, so that a clean run fails any of them with probability at most alpha."""
    statistical = [c for c in checks if c.p_value is not None]
    for c in statistical:
        c.passed = c.p_value > alpha / len(statistical)
        c.detail += f" [p = {c.p_value:.3g} vs alpha {alpha:g} / {len(statistical)} tests of this audit]"
    return checks


UPDATE = "release → update"  # the optimizer reads the noisy release after public post-processing only
PRECISION = "noise precision"  # release - value is not on the bf16 / fp16 grid (audit/precision.py)
TWO_STEP = "two-step sensitivity"  # state a release sets moves the next release only through the release (audit/two_step.py)
VALIDATION = "validation score"  # the final validation release: what it reads and its noise (audit/validation.py)
NULL = "noise per tensor"  # every noised tensor carries noise at every coordinate (audit/precision.py)
CHECK_ORDER = ("noise", PRECISION, NULL, "noise across runs", "independence", "sensitivity", TWO_STEP, UPDATE, VALIDATION,
               "sampler", "accounting")


@dataclass
class AuditReport:
    """What `run_audit` found; audit.json is `to_json()`."""

    algo: str
    model: str
    dataset: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {"algo": self.algo, "model": self.model, "dataset": self.dataset, "passed": self.passed,
                "checks": [asdict(c) for c in self.checks]}

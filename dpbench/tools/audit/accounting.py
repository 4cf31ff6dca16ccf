"""The accounting checks of `dpbench-audit` (dpbench/tools/audit/runner.py): one mechanism per sampled
batch, the ledger as planned, and the reported epsilon against Google's dp-accounting."""

from __future__ import annotations

from dpbench.privacy.mechanisms import (
    SeveralMechanismsPerBatchError,
)
from dpbench.tools.audit.report import (
    Check,
)


def _dp_accounting_epsilons(ledger, delta: float) -> dict[str, float]:
    """epsilon of the ledger by dp-accounting's RDP and PLD accountants (independent of ours)."""
    import dp_accounting as dpa

    from dpbench.study import (
        ledger_dp_event,  # the one ledger -> dp-accounting conversion
    )

    replace_one = all(m.neighboring == "replace_one" for m, _ in ledger.items())
    relation = dpa.NeighboringRelation.REPLACE_ONE if replace_one else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    event = ledger_dp_event(ledger, exact_replace_one=replace_one)
    out = {}
    from dpbench.tools.report.recheck import pld_upper_bound  # its grid refined until epsilon settles, as pld's

    out["pld"] = pld_upper_bound(event, relation, delta)
    try:
        rdp = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        out["rdp"] = float(rdp.compose(event).get_epsilon(delta))
    except Exception:  # dp-accounting's RDP has no replace-one Poisson analysis: add/remove at sigma/2
        halved = ledger_dp_event(ledger)
        out["rdp"] = float(dpa.rdp.RdpAccountant().compose(halved).get_epsilon(delta))
    return out


def several_mechanisms_check(error: Exception) -> Check:
    """A plan that charges a step's releases as several independent mechanisms: refused."""
    return Check("accounting", "one mechanism per sampled batch", 2.0, 1.0, False,
                 f"{error} (charging them as independent understates epsilon)")


def accounting_check(job) -> list[Check]:
    """The planned ledger's epsilon by dp-accounting vs the epsilon the configured accountant reports."""
    plan = job.privacy
    try:
        ledger = plan.planned_ledger(job.steps, final=True)  # Poisson steps or a shuffled run's epochs, the validation score
    except SeveralMechanismsPerBatchError as error:
        return [several_mechanisms_check(error)]
    if not ledger:
        return [Check("accounting", "ledger", 0.0, 0.0, True, "the planned run releases nothing")]
    reported = plan.epsilon(ledger)
    if getattr(plan, "parallel_final", False):  # the score on the disjoint validation part: the larger part's epsilon
        from dpbench.privacy.mechanisms import split_off

        parts = [_dp_accounting_epsilons(part, plan.delta) for part in split_off(ledger, plan.final_releases) if part]
        independent = {name: max(p[name] for p in parts) for name in ("pld", "rdp")}
    else:
        independent = _dp_accounting_epsilons(ledger, plan.delta)
    tight = independent["pld"]
    passed = reported >= tight * (1 - 2e-3) - 1e-3
    return [
        Check("accounting", f"{job.steps} planned steps", reported, tight, passed,
              f"{plan.accountant.computed_by} reports eps = {reported:.4f}; dp-accounting gives PLD {tight:.4f}, "
              f"RDP {independent['rdp']:.4f} at delta {plan.delta:g} (sigma {plan.setup.noise_multiplier:.4f})")
    ]

"""Accountants never crash or answer infinity for a small epsilon: PRV's grid that would not fit in
memory falls back to pld (and says so), and gdp's root bracket failing at the low end is epsilon 0,
each checked against dp-accounting's PLD."""

from __future__ import annotations

import math

import pytest

from dpbench.privacy.accountants import MAX_PRV_GRID_POINTS, build_accountant, prv_grid_points
from dpbench.privacy.mechanisms import GaussianMechanism, new_ledger

DELTA = 1e-5


def ledger(sigma: float, q: float, steps: int):
    planned = new_ledger(None)
    for _ in range(steps):
        planned.add_step([GaussianMechanism(sigma, q)])
    return planned


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_prv_whose_grid_would_not_fit_falls_back_to_pld():
    """q = 0.3, sigma = 0.5, 1e5 steps: Opacus's PRV asked for a 57 GiB grid (a MemoryError)."""
    from opacus.accountants import PRVAccountant

    opacus = PRVAccountant()
    opacus.history = [(0.5, 0.3, 100_000)]
    assert prv_grid_points(opacus, DELTA, eps_error=0.01) > MAX_PRV_GRID_POINTS
    run = ledger(0.5, 0.3, 100_000)
    prv = build_accountant("prv")
    epsilon = prv.epsilon(run, DELTA)
    assert prv.computed_by == "pld" and epsilon == build_accountant("pld").epsilon(run, DELTA)
    assert 262 < epsilon < math.inf


def test_prv_on_a_usual_run_stays_prv():
    prv = build_accountant("prv")
    epsilon = prv.epsilon(ledger(1.0, 0.01, 1000), DELTA)
    assert prv.computed_by == "prv"
    assert epsilon == pytest.approx(build_accountant("pld").epsilon(ledger(1.0, 0.01, 1000), DELTA), rel=0.05)


def test_gdp_answers_zero_where_delta_is_met_at_epsilon_zero():
    """q = 1e-4, sigma = 5, one step: the true epsilon is about 0 (pld: 0); Opacus's bracket finds no
    root and gdp used to answer infinity."""
    run = ledger(5.0, 1e-4, 1)
    assert build_accountant("pld").epsilon(run, DELTA) < 1e-3
    assert build_accountant("gdp").epsilon(run, DELTA) == 0.0


def test_gdp_still_answers_infinity_only_beyond_its_bracket():
    assert build_accountant("gdp").epsilon(ledger(0.3, 0.5, 10_000), DELTA) == math.inf
    middle = build_accountant("gdp").epsilon(ledger(1.0, 0.01, 1000), DELTA)
    assert 0 < middle < 10


def test_a_pld_grid_too_large_for_memory_is_never_built(monkeypatch):
    """A near-noiseless sigma needs a loss grid the kernel's OOM killer ends the process for before
    numpy raises MemoryError (sigma 0.02, q 0.1, T 1,000: 2e8 points, 17 GB at 1e-3): each grid's
    size is checked before it is built; refinement keeps the coarser bound, and where even the
    coarsest grid is too large pld answers with rdp and says so."""
    from dp_accounting.pld import privacy_loss_distribution

    from dpbench.privacy import accountants
    from dpbench.privacy.events import accounted_ledger

    run = ledger(0.537, 0.01, 300)  # a ledger no other test asks for (the PLDs are memoised)
    record = accounted_ledger(run)
    coarse = accountants._pld_of(record.relation, tuple(record.mechanisms), DELTA, 1e-2, True)
    accountants._pld_of.cache_clear()
    built = []
    original = privacy_loss_distribution.from_gaussian_mechanism
    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism",
                        lambda *a, **k: built.append(k["value_discretization_interval"]) or original(*a, **k))

    monkeypatch.setattr(accountants, "MAX_PLD_POINTS", coarse[1] * 5)  # 1e-2 fits, 1e-3 (10x the points) does not
    pld = build_accountant("pld")
    assert pld.epsilon(run, DELTA) == coarse[0] and (pld.computed_by, pld.interval_used) == ("pld", 1e-2)
    assert set(built) == {1e-2}  # the finer grid was never built
    assert pld.bounds(run, DELTA)[1] == coarse[0]

    accountants._pld_of.cache_clear()
    monkeypatch.setattr(accountants, "MAX_PLD_POINTS", coarse[1] // 2)  # not even 1e-2 fits
    monkeypatch.setattr(accountants, "prv_grid_points", lambda *a, **k: math.inf)  # prv falls back to pld, pld to rdp
    for name in ("pld", "prv"):
        accountant = build_accountant(name)
        epsilon = accountant.epsilon(run, DELTA)
        assert accountant.computed_by == "rdp" and epsilon == build_accountant("rdp").epsilon(run, DELTA), name
        assert accountant.bounds(run, DELTA) == (None, epsilon)

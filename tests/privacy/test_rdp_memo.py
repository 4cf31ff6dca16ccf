"""The RDP accountant's memo of one step's RDP (dpbench/privacy/accountants.py): the epsilon is
bit-identical to Opacus's compute_rdp over the whole ledger, and repeated questions reuse it."""

from __future__ import annotations

import warnings

import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from dpbench.privacy.accountants import RDP_ORDERS, RDPAccountant, rdp_of_one_step
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger

LEDGERS = [
    [((0.125, 0.6), 3)],
    [((0.01, 1.1), 1000), ((0.01, 2.3), 40)],  # two mechanisms per step (DC-DPSGD's score and gradient)
    [((1.0, 5.0), 7)],  # full batch
]


def opacus_epsilon(entries, delta: float) -> float:
    rdp = sum(compute_rdp(q=q, noise_multiplier=sigma, steps=n, orders=RDP_ORDERS) for (q, sigma), n in entries)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_privacy_spent(orders=RDP_ORDERS, rdp=rdp, delta=delta)[0])


@pytest.mark.parametrize("entries", LEDGERS)
def test_the_memoised_rdp_gives_opacus_epsilon_bit_for_bit_and_is_reused(entries):
    ledger = Ledger()
    for (q, sigma), n in entries:
        ledger.add(GaussianMechanism(sigma, q), n)
    accountant = RDPAccountant()
    assert accountant.epsilon(ledger, 1e-5) == opacus_epsilon(entries, 1e-5)
    hits = rdp_of_one_step.cache_info().hits
    assert accountant.epsilon(ledger, 1e-6) == opacus_epsilon(entries, 1e-6)
    assert rdp_of_one_step.cache_info().hits == hits + len(entries)  # no step's RDP computed again

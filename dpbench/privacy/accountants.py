"""Accountants: epsilon of a ledger, and the noise multiplier that meets a target epsilon.

They wrap the field's libraries instead of re-deriving formulas:
  rdp  Opacus's RDP analysis (orders extended to 1024 like dp-accounting's, for small epsilon)
  prv  Opacus's PRV accountant (falls back to pld, recorded in the run's notes, when PRV's
       discretisation fails or its grid would not fit in memory)
  gdp  Opacus's Gaussian-DP (CLT) accountant: homogeneous ledgers only; an APPROXIMATION that can
       under-report epsilon (1.21 against a tight 1.79 at sigma=1.1, q=0.0445, 40 steps), so it is
       not an upper bound and calibrating sigma with it needs an explicit opt-in
  pld  Google's dp-accounting privacy-loss-distribution accountant (pessimistic discretisation)

rdp, prv and pld give upper bounds on epsilon (`upper_bound = True`); gdp does not.

Mechanisms stated under replace-one (`privacy.neighboring=replace_one`) are accounted exactly by
pld (dp-accounting's REPLACE_ONE relation) and through the conservative add/remove reduction
`GaussianMechanism.add_remove_noise_multiplier` (sigma/2) by the Opacus-based accountants.
The ledger of a shuffled run holds one q = 1 mechanism per epoch (`ShuffledLedger`): plain
Gaussians, which every accountant composes (pld and prv tightly, rdp loosely).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Callable

from dpbench.errors import UserError
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger, new_ledger
from dpbench.registry import Registry

ACCOUNTANTS: Registry[type["Accountant"]] = Registry("accountant")

RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]


@lru_cache(maxsize=4096)
def rdp_of_one_step(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    """Opacus's RDP of one sampled-Gaussian step at RDP_ORDERS. Memoised: calibration and every
    evaluation's epsilon ask again for the same (q, sigma), and Opacus takes milliseconds per
    fractional order. Its compute_rdp is this times `steps`, so the sums below are bit-identical."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDP_ORDERS))


class Accountant(ABC):
    name: str
    upper_bound: bool = True  # whether epsilon() is a proven upper bound (not an approximation)

    def __init__(self) -> None:
        self.computed_by = self.name  # the accountant that computed the last epsilon (fallbacks)

    def epsilon(self, ledger: Ledger, delta: float) -> float:
        """Epsilon spent by every mechanism in the ledger, at the given delta."""
        self.computed_by = self.name
        if not ledger:
            return 0.0
        if any(m.noise_multiplier == 0 for m, _ in ledger.items()):
            return math.inf  # a noiseless release
        return self._epsilon(ledger, delta)

    @abstractmethod
    def _epsilon(self, ledger: Ledger, delta: float) -> float: ...


@ACCOUNTANTS.register("rdp")
class RDPAccountant(Accountant):
    name = "rdp"

    def _epsilon(self, ledger: Ledger, delta: float) -> float:
        import numpy as np
        from opacus.accountants.analysis.rdp import get_privacy_spent

        rdp = sum(np.array(rdp_of_one_step(m.sample_rate, m.add_remove_noise_multiplier)) * n for m, n in ledger.items())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "optimal order is the largest alpha": grid reaches 1024
            eps, _ = get_privacy_spent(orders=RDP_ORDERS, rdp=rdp, delta=delta)
        return float(eps)


@ACCOUNTANTS.register("pld")
class PLDAccountant(Accountant):
    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-3):
        super().__init__()
        self.value_discretization_interval = value_discretization_interval

    def _epsilon(self, ledger: Ledger, delta: float) -> float:
        import dp_accounting as dpa

        items = ledger.items()
        if all(m.neighboring == "replace_one" for m, _ in items):  # exact replace-one accounting
            relation, multipliers = dpa.NeighboringRelation.REPLACE_ONE, [m.noise_multiplier for m, _ in items]
        else:  # add/remove, or a mixed ledger: replace-one mechanisms through the sigma/2 reduction
            relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
            multipliers = [m.add_remove_noise_multiplier for m, _ in items]
        events = [
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(m.sample_rate, dpa.GaussianDpEvent(sigma)), n)
            for (m, n), sigma in zip(items, multipliers)
        ]
        accountant = dpa.pld.PLDAccountant(
            neighboring_relation=relation, value_discretization_interval=self.value_discretization_interval
        )
        accountant.compose(dpa.ComposedDpEvent(events))
        return float(accountant.get_epsilon(delta))


@ACCOUNTANTS.register("prv")
class PRVAccountant(Accountant):
    name = "prv"

    def _epsilon(self, ledger: Ledger, delta: float) -> float:
        from opacus.accountants import PRVAccountant as OpacusPRV

        accountant = OpacusPRV()
        accountant.history = [(m.add_remove_noise_multiplier, m.sample_rate, n) for m, n in ledger.items()]
        with warnings.catch_warnings():  # q = 1 (shuffled epochs): PRV's log(1 - q) is -inf, harmlessly
            warnings.simplefilter("ignore", RuntimeWarning)
            return self._prv_epsilon(accountant, ledger, delta)

    def _prv_epsilon(self, accountant, ledger: Ledger, delta: float) -> float:
        try:
            if prv_grid_points(accountant, delta, eps_error=0.01) > MAX_PRV_GRID_POINTS:
                raise MemoryError  # PRV's mesh would not fit (57 GiB at q = 0.3, sigma = 0.5, 1e5 steps)
            # Upper bound of PRV's estimate; eps_error scales with the answer, so a fixed one is too coarse for small epsilons.
            first = accountant.get_epsilon(delta, eps_error=0.01)
            if first < 1.0:
                return float(accountant.get_epsilon(delta, eps_error=0.01 * max(first, 0.05)))
            return float(first)
        except (RuntimeError, ValueError, MemoryError):
            self.computed_by = "pld"  # the run records it: privacy.accountant names pld, and a note
            return PLDAccountant().epsilon(ledger, delta)


# PRV discretises the composed loss on one grid of float64 points, several copies at once (FFT):
# 2^24 points keep it under about 1 GiB; beyond, the pld accountant (also an upper bound) answers.
MAX_PRV_GRID_POINTS = 2**24


def prv_grid_points(accountant, delta: float, eps_error: float) -> int:
    """The number of points of the grid Opacus's PRV accountant would allocate for its history
    (its own `_get_domain`, asked before anything is allocated)."""
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in accountant.history]
    domain = accountant._get_domain(prvs=prvs, num_self_compositions=[n for _, _, n in accountant.history],
                                    eps_error=eps_error, delta_error=delta / 1000)
    return int(domain.size)


@ACCOUNTANTS.register("gdp")
class GDPAccountant(Accountant):
    name = "gdp"
    upper_bound = False  # central-limit approximation: can under-report epsilon

    def _epsilon(self, ledger: Ledger, delta: float) -> float:
        from opacus.accountants.analysis import gdp

        items = ledger.items()
        if len(items) != 1:
            raise UserError(
                "the gdp accountant handles one constant (sigma, q) only; this run composes "
                f"{len(items)} different mechanisms: use accountant=rdp, prv or pld"
            )
        (m, n), = items
        mu = gdp.compute_mu_poisson(steps=n, noise_multiplier=m.add_remove_noise_multiplier, sample_rate=m.sample_rate)
        # Opacus brackets epsilon in [0, 500]: no root means delta is met at epsilon 0 already, or
        # only beyond 500 (the dual's delta decreases in epsilon)
        if gdp.delta_eps_mu(eps=0.0, mu=mu) <= delta:
            return 0.0
        if gdp.delta_eps_mu(eps=500.0, mu=mu) > delta:
            return math.inf
        return float(gdp.eps_from_mu(mu=mu, delta=delta))


def build_accountant(name: str) -> Accountant:
    return ACCOUNTANTS.get(name)()


MAX_NOISE_MULTIPLIER = 1e4


def calibrate_noise_multiplier(
    accountant: Accountant,
    ledger_for: Callable[[float], Ledger],
    target_epsilon: float,
    delta: float,
    tolerance: float = 0.01,
) -> float:
    """Smallest noise multiplier (up to `tolerance` in epsilon) whose planned ledger meets the target.

    `ledger_for(sigma)` builds the planned run's ledger for a base noise multiplier, so algorithms
    with several mechanisms per step (DC-DPSGD, DPDR) calibrate through the same code. Returns the
    upper end of the bisection bracket, so the achieved epsilon is at most the target (Opacus's
    get_noise_multiplier does the same, for one mechanism only).
    """
    return smallest_noise_multiplier(
        lambda sigma: accountant.epsilon(ledger_for(sigma), delta), target_epsilon, tolerance,
        f"no noise multiplier reaches epsilon={target_epsilon} at delta={delta} for "
        "this run: raise privacy.epsilon or privacy.delta, or plan fewer steps",
    )


def smallest_noise_multiplier(epsilon_of: Callable[[float], float], target_epsilon: float, tolerance: float,
                              unreachable: str) -> float:
    """Smallest sigma (up to `tolerance` in epsilon) with epsilon_of(sigma) <= target, epsilon_of
    decreasing in sigma (a run's calibration, a study's per-trial sigma). Returns the bracket's
    upper end, so the result meets the target; `unreachable` is the error when no sigma up to
    MAX_NOISE_MULTIPLIER does."""
    cache: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in cache:
            cache[sigma] = epsilon_of(sigma)
        return cache[sigma]

    high = 1.0
    if eps(high) <= target_epsilon:  # search downwards for a bracket
        low = high / 2
        while eps(low) <= target_epsilon:
            high, low = low, low / 2
            if low < 1e-4:
                return high
    else:  # search upwards
        low = high
        while eps(high) > target_epsilon:
            low, high = high, high * 2
            if high > MAX_NOISE_MULTIPLIER:
                raise UserError(unreachable)
    # invariant: eps(low) > target >= eps(high)
    while target_epsilon - eps(high) > tolerance and high - low > 1e-6 * high:
        mid = (low + high) / 2
        if eps(mid) > target_epsilon:
            low = mid
        else:
            high = mid
    return high


def ledger_of_plan(
    mechanisms_for_step: Callable[[int], list[GaussianMechanism]], steps: int, batches_per_epoch: int | None = None,
    final_releases: tuple[GaussianMechanism, ...] = (),
) -> Ledger:
    """The ledger of a planned run: Poisson batches, or shuffled ones (`batches_per_epoch`), the
    same accumulation the trainer does for the steps that run, then `final_releases` (made once
    after training, e.g. the validation score: `Ledger.add_release`)."""
    ledger = new_ledger(batches_per_epoch)
    for step in range(steps):
        ledger.add_step(mechanisms_for_step(step))
    for mechanism in final_releases:
        ledger.add_release(mechanism)
    return ledger


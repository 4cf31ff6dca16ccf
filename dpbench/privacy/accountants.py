"""Accountants: epsilon of a ledger, and the noise multiplier that meets a target epsilon.

They wrap the field's libraries instead of re-deriving formulas:
  rdp  Opacus's RDP analysis (orders extended to 1024 like dp-accounting's, for small epsilon)
  prv  Opacus's PRV accountant (falls back to pld, recorded in the run's notes, when PRV's
       discretisation fails or its grid would not fit in memory)
  gdp  Opacus's Gaussian-DP (CLT) accountant: homogeneous ledgers only; an APPROXIMATION that can
       under-report epsilon (1.21 against a tight 1.79 at sigma=1.1, q=0.0445, 40 steps), so it is
       not an upper bound and calibrating sigma with it needs an explicit opt-in
  pld  Google's dp-accounting privacy-loss-distribution accountant (pessimistic discretisation,
       its interval refined until epsilon settles): the default, the tightest of them

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
        self._last: tuple | None = None  # (ledger items, delta, epsilon, computed_by): bounds() asks again

    def epsilon(self, ledger: Ledger, delta: float) -> float:
        """Epsilon spent by every mechanism in the ledger, at the given delta."""
        self.computed_by = self.name
        if not ledger:
            return 0.0
        items = tuple(ledger.items())
        if any(m.noise_multiplier == 0 for m, _ in items):
            return math.inf  # a noiseless release
        if self._last is not None and self._last[:2] == (items, delta):
            self.computed_by = self._last[3]
            return self._last[2]
        epsilon = self._epsilon(ledger, delta)
        self._last = (items, delta, epsilon, self.computed_by)
        return epsilon

    @abstractmethod
    def _epsilon(self, ledger: Ledger, delta: float) -> float: ...

    def bounds(self, ledger: Ledger, delta: float) -> tuple[float | None, float | None]:
        """(lower, upper) epsilon of the ledger where the accountant gives them (pld: optimistic and
        pessimistic discretisations; prv: its error bounds); None where it does not."""
        epsilon = self.epsilon(ledger, delta)
        return None, (epsilon if self.upper_bound else None)

    def quick(self) -> "Accountant":
        """A faster upper bound that finds sigma roughly before this accountant decides near it (pld: its 1e-3 grid)."""
        return self

    def settle_for(self, ledger: Ledger, delta: float) -> None:
        """Fix what this accountant chooses per ledger (pld's interval) to what suits `ledger`, the
        planned run near calibration's answer: the bisection and the reported epsilon then agree."""


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
    """dp-accounting's privacy loss distributions, pessimistic (an upper bound at every interval).

    The loss grid's interval sets how far above the true epsilon the bound lies, and what suffices
    depends on q and T more than on epsilon (1e-3 is 2x too high at q = 1e-4, T = 1e5; 1e-4 is
    within 0.01% at q = 0.01): with `value_discretization_interval=None` (the default) each epsilon
    follows `refined_pld` (tenfold finer from 1e-2 while the bias left may exceed 0.5%, down to
    1e-5) and reports the smallest bound met. Calibration settles one interval near its answer
    (`settle_for`), which the run's reported epsilon then keeps.
    """

    name = "pld"

    def __init__(self, value_discretization_interval: float | None = None):
        super().__init__()
        self.value_discretization_interval = value_discretization_interval  # None: chosen per ledger
        self.interval_used: float | None = value_discretization_interval  # that of the last epsilon

    def _epsilon(self, ledger: Ledger, delta: float) -> float:
        try:
            return self._pld_epsilon(ledger, delta)
        except (ValueError, MemoryError):  # a near-noiseless sigma: the loss grid would not fit in memory
            self.computed_by = "rdp"  # also an upper bound; the run records it in privacy.accountant and a note
            return RDPAccountant().epsilon(ledger, delta)

    def _pld_epsilon(self, ledger: Ledger, delta: float) -> float:
        if self.value_discretization_interval is not None:
            return pld_epsilon(ledger, delta, self.value_discretization_interval)
        self.interval_used, epsilon = refined_pld(lambda interval: pld_epsilon(ledger, delta, interval))
        return epsilon

    def quick(self) -> "Accountant":
        return PLDAccountant(PLD_INTERVALS[1])  # 1.4% high at q = 0.01, T = 1e5 (1e-2: 3x); rdp's fractional orders are slower

    def settle_for(self, ledger: Ledger, delta: float) -> None:
        if self.value_discretization_interval is None:
            self.epsilon(ledger, delta)
            self.value_discretization_interval, self._last = self.interval_used, None

    def bounds(self, ledger: Ledger, delta: float) -> tuple[float | None, float | None]:
        """(optimistic, pessimistic) epsilon at the interval of the last epsilon: the optimistic
        estimate (privacy buckets rounding losses down) is a lower bound, 0 where the grid is coarser
        than small-q losses."""
        upper = self.epsilon(ledger, delta)
        if not ledger or math.isinf(upper):
            return upper, upper
        if self.computed_by != self.name:  # rdp answered: an upper bound only
            return None, upper
        try:
            lower = pld_epsilon(ledger, delta, self.interval_used or PLD_INTERVALS[1], pessimistic=False)
        except PLDGridTooLarge:
            lower = None
        return lower, upper


PLD_INTERVALS = (1e-2, 1e-3, 1e-4, 1e-5)  # the ladder refined_pld walks down
PLD_BIAS_LEFT = 0.005  # relative bias, as estimated from the last refinement, at which it stops


def refined_pld(epsilon_at: Callable[[float], float]) -> tuple[float, float]:
    """(interval, epsilon): a pessimistic PLD epsilon (`epsilon_at(interval)`, an upper bound at
    every interval) refined tenfold down PLD_INTERVALS until the bias it may still carry is below
    PLD_BIAS_LEFT of it. The bias shrinks like interval^p with p >= 1 (measured: p is 1 to 2 on the
    reference points), so the last refinement's gain / 9 bounds the bias left; a coarse grid that is
    already tight stops after two cheap grids instead of paying for a fine one (the fine grid's
    points are one Python call each in dp-accounting: 1e-4 is seconds at sigma 0.6, q = 0.06, T = 3,
    where 1e-2 and 1e-3 agree to 5 digits). The smallest bound met is returned: each is sound. A
    finer grid larger than MAX_PLD_POINTS (a near-noiseless sigma) is not tried: the last bound stands."""
    interval, epsilon = PLD_INTERVALS[0], epsilon_at(PLD_INTERVALS[0])
    for finer in PLD_INTERVALS[1:]:
        try:
            finer_epsilon = epsilon_at(finer)
        except PLDGridTooLarge:  # the coarser bound is sound; a finer grid would not fit in memory
            break
        bias_left = (epsilon - finer_epsilon) / 9
        interval, epsilon = finer, min(epsilon, finer_epsilon)
        if not bias_left > PLD_BIAS_LEFT * epsilon:  # nan (inf - inf): nothing to refine
            break
    return interval, epsilon


def pld_epsilon(ledger: Ledger, delta: float, interval: float, pessimistic: bool = True) -> float:
    """dp-accounting's PLD epsilon of the ledger's events (`dpbench.privacy.events.ledger_events`)
    at one discretisation interval; pessimistic: an upper bound, else an optimistic lower one."""
    from dpbench.privacy.events import accounted_ledger

    record = accounted_ledger(ledger)
    return _pld_of(record.relation, tuple(record.mechanisms), delta, interval, pessimistic)[0]


MAX_PLD_POINTS = 2**23  # a loss grid of 8.4M points: the composition's FFT buffers stay near 0.5 GiB


class PLDGridTooLarge(MemoryError):
    """The PLD at this interval needs a loss grid larger than MAX_PLD_POINTS. A near-noiseless sigma
    does (sigma = 0.02, q = 0.1, T = 1,000 needs 2e8 points, 17 GB, at 1e-3): refined_pld keeps the
    coarser bound, and pld falls back to rdp where even 1e-2 is too fine. Raised before the grid is
    built, because numpy's MemoryError never comes: the kernel's OOM killer ends the process first."""


def _check_grid(points: float, interval: float, what: str) -> None:
    if points > MAX_PLD_POINTS:
        raise PLDGridTooLarge(f"{what} at interval {interval:g} needs {points:.3g} loss points (> {MAX_PLD_POINTS})")


@lru_cache(maxsize=1024)
def _pld_of(relation, mechanisms: tuple, delta: float, interval: float, pessimistic: bool) -> tuple[float, int]:
    """(epsilon, points of the largest loss grid formed), memoised: a study's trials, an audit's jobs
    and a grid's runs ask again for the same ledger, and one fine grid costs seconds. Every grid's size is checked before it is
    built (PLDGridTooLarge): first by `check_pld_grids`, then a composition's exactly from
    dp-accounting's own truncation bounds."""
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld

    check_pld_grids(relation, mechanisms, interval)
    composed, largest = None, 0
    for mechanism, count in mechanisms:  # (sigma, sample rate) under relation
        sigma, rate = mechanism
        full_batch = rate == 1.0  # T full-batch Gaussians are one Gaussian of sigma / sqrt(T): exact and fast
        sigma_step = sigma / math.sqrt(count) if full_batch else sigma
        one = pld.from_gaussian_mechanism(sigma_step, sampling_prob=rate, value_discretization_interval=interval,
                                          pessimistic_estimate=pessimistic, use_connect_dots=pessimistic,
                                          neighboring_relation=relation)
        if not full_batch and count > 1:
            for pmf in _pmfs(one):  # a sparse one (few points) goes dense when composed many times
                dense = pmf if hasattr(pmf, "_probs") else pmf.to_dense_pmf()
                low, high = common.compute_self_convolve_bounds(dense._probs, count, 1e-15)  # what self_compose allocates
                _check_grid(high - low + 1, interval, f"{count} steps")
            one = one.self_compose(count)
        largest = max([largest] + [pmf.size for pmf in _pmfs(one)])
        composed = one if composed is None else composed.compose(one)
    if interval == PLD_INTERVALS[0] and pessimistic:
        _COARSE_POINTS[(relation, mechanisms)] = largest
    return float(composed.get_epsilon_for_delta(delta)), largest


def _pmfs(distribution) -> list:
    """The loss distributions (remove, and add where it differs) of a dp-accounting PLD: its internals,
    which no public accessor gives (pinned by constraints.txt; tests/privacy/test_accountant_limits.py)."""
    return [pmf for pmf in (distribution._pmf_remove, distribution._pmf_add) if pmf is not None]


_COARSE_POINTS: dict[tuple, int] = {}  # (relation, mechanisms) -> points of their largest grid at PLD_INTERVALS[0]


def check_pld_grids(relation, mechanisms: tuple, interval: float) -> None:
    """Raise PLDGridTooLarge where dp-accounting's PLD of `mechanisms` ((sigma, sample rate), count)
    at `interval` would form a grid larger than MAX_PLD_POINTS, before any is built: a step's size
    from its loss range, a composition's from its size at the coarsest interval (sizes scale as
    1 / interval; the coarsest is built once, and is what refined_pld starts from)."""
    for (sigma, rate), count in mechanisms:
        sigma_step = sigma / math.sqrt(count) if rate == 1.0 else sigma
        _check_grid(_loss_range(sigma_step, rate, relation) / interval, interval, "one step")
    if interval < PLD_INTERVALS[0]:
        if (relation, mechanisms) not in _COARSE_POINTS:
            _pld_of(relation, mechanisms, 1e-5, PLD_INTERVALS[0], True)  # records its size (delta changes no size)
        _check_grid(_COARSE_POINTS[(relation, mechanisms)] * PLD_INTERVALS[0] / interval, interval, "the composition")


def _loss_range(sigma: float, rate: float, relation) -> float:
    """Width of one step's privacy-loss support (dp-accounting's own connect-dots bounds): its grid
    holds width / interval points."""
    import dp_accounting as dpa
    from dp_accounting.pld import privacy_loss_mechanism as plm

    types = ([plm.AdjacencyType.REPLACE] if relation == dpa.NeighboringRelation.REPLACE_ONE
             else [plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD])
    widths = []
    for adjacency in types:
        bounds = plm.GaussianPrivacyLoss(sigma, sampling_prob=rate, adjacency_type=adjacency).connect_dots_bounds()
        widths.append(bounds.epsilon_upper - bounds.epsilon_lower)
    return max(widths)


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
            self._eps_error = 0.01
            if first < 1.0:
                self._eps_error = 0.01 * max(first, 0.05)
                return float(accountant.get_epsilon(delta, eps_error=self._eps_error))
            return float(first)
        except (RuntimeError, ValueError, MemoryError):
            fallback = PLDAccountant()
            epsilon = fallback.epsilon(ledger, delta)
            self.computed_by = fallback.computed_by  # pld (or rdp, pld's own fallback): the run records it, and a note
            return epsilon

    def bounds(self, ledger: Ledger, delta: float) -> tuple[float | None, float | None]:
        """PRV's own (lower, upper) error bounds at the eps_error its epsilon used; pld's where PRV fell back to it."""
        from opacus.accountants import PRVAccountant as OpacusPRV

        epsilon = self.epsilon(ledger, delta)
        if not ledger or math.isinf(epsilon):
            return epsilon, epsilon
        if self.computed_by != self.name:
            return PLDAccountant().bounds(ledger, delta)
        accountant = OpacusPRV()
        accountant.history = [(m.add_remove_noise_multiplier, m.sample_rate, n) for m, n in ledger.items()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lower, _ = prv_bounds(accountant, delta, eps_error=getattr(self, "_eps_error", 0.01))
        return lower, epsilon


def prv_bounds(accountant, delta: float, eps_error: float) -> tuple[float, float]:
    """(lower, upper) epsilon of Opacus's PRV accountant's history: its get_epsilon returns the upper."""
    delta_error = delta / 1000  # Opacus's default
    dprv = accountant._get_dprv(eps_error=eps_error, delta_error=delta_error)
    lower, _, upper = dprv.compute_epsilon(delta, delta_error, eps_error)
    return float(lower), float(upper)


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
    unreachable = (f"no noise multiplier reaches epsilon={target_epsilon} at delta={delta} for "
                   "this run: raise privacy.epsilon or privacy.delta, or plan fewer steps")
    quick = accountant.quick()  # a fast bound first, then the accountant's own rule near its answer
    if quick is accountant:
        return smallest_noise_multiplier(lambda s: accountant.epsilon(ledger_for(s), delta), target_epsilon, tolerance,
                                         unreachable)
    sigma, slope = secant_noise_multiplier(lambda s: quick.epsilon(ledger_for(s), delta), target_epsilon, tolerance,
                                           unreachable, start=1.0)
    accountant.settle_for(ledger_for(sigma), delta)
    return secant_noise_multiplier(lambda s: accountant.epsilon(ledger_for(s), delta), target_epsilon, tolerance,
                                   unreachable, start=sigma, slope=slope)[0]


def secant_noise_multiplier(epsilon_of: Callable[[float], float], target_epsilon: float, tolerance: float,
                            unreachable: str, start: float, slope: float = -1.0) -> tuple[float, float]:
    """Smallest sigma (up to `tolerance` in epsilon) with epsilon_of(sigma) <= target, as
    `smallest_noise_multiplier` finds it, for an expensive epsilon_of: secant steps on
    (log sigma, log epsilon) aimed at target - tolerance / 2, from `start` with the guessed `slope`
    (d log eps / d log sigma, negative), each kept inside the bracket found so far and at least a
    tenth of it from either end (so it shrinks even where the secant stalls); steps before a
    bracket exists are at most 2x. Returns (a sigma whose epsilon is at most the target, the last
    slope: a finer accountant's first guess)."""
    if not target_epsilon > 0:
        raise UserError(unreachable)
    aim = math.log(target_epsilon - min(tolerance, target_epsilon) / 2)
    low = high = None  # log sigma with epsilon above the target / at most the target
    previous = None  # (log sigma, log epsilon) of the evaluation before
    x = math.log(start)
    for _ in range(100):
        sigma = _on_sigma_grid(x)
        x = math.log(sigma)
        if sigma > MAX_NOISE_MULTIPLIER:
            raise UserError(unreachable)
        epsilon = epsilon_of(sigma)
        if epsilon <= target_epsilon:
            if epsilon >= target_epsilon - tolerance:
                return sigma, slope
            high = x
        else:
            low = x
        if low is not None and high is not None and high - low < 1e-6:
            return _on_sigma_grid(high), slope
        y = math.log(epsilon) if 0 < epsilon < math.inf else None
        step_slope = slope
        if previous is not None and y is not None and previous[1] is not None and previous[0] != x:
            step_slope = (y - previous[1]) / (x - previous[0])
            if step_slope < 0 and math.isfinite(step_slope):
                slope = step_slope
        if y is None or not (step_slope < 0 and math.isfinite(step_slope)):
            step = math.log(2) if epsilon > target_epsilon else -math.log(2)  # infinite, zero or flat: double or halve
        else:
            step = (aim - y) / step_slope
        previous, x = (x, y), x + max(-math.log(2), min(math.log(2), step))
        if low is not None and high is not None:
            span = high - low
            x = min(max(x, low + span / 10), high - span / 10)
    if high is None:
        raise UserError(unreachable)
    return _on_sigma_grid(high), slope


def _on_sigma_grid(log_sigma: float) -> float:
    """exp(log_sigma) rounded up to a 2^-20 grid, as bisection's sigmas are: sigma * C / C is then
    sigma again where a mechanism's std is sigma * C (its ledger records the sigma the run reports)."""
    return math.ceil(math.exp(log_sigma) * 2**20) / 2**20


def smallest_noise_multiplier(epsilon_of: Callable[[float], float], target_epsilon: float, tolerance: float,
                              unreachable: str, start: float = 1.0, shrink: float = 0.5) -> float:
    """Smallest sigma (up to `tolerance` in epsilon) with epsilon_of(sigma) <= target, epsilon_of
    decreasing in sigma (a run's calibration, a study's per-trial sigma). Returns the bracket's
    upper end, so the result meets the target; `unreachable` is the error when no sigma up to
    MAX_NOISE_MULTIPLIER does. `start`: where the bracket search begins, stepping down by `shrink` (a sigma known to be close)."""
    cache: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in cache:
            cache[sigma] = epsilon_of(sigma)
        return cache[sigma]

    high = start
    if eps(high) <= target_epsilon:  # search downwards for a bracket
        low = high * shrink
        while eps(low) <= target_epsilon:
            high, low = low, low * shrink
            if low < 1e-4:
                return high
    else:  # search upwards
        low = high
        while eps(high) > target_epsilon:
            low, high = high, high / shrink
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


"""A study's trials: K, their random number, drawn from OS entropy, and the selection among their
outcomes (the accounting that makes K random pay off: accounting.py).

`shape` picks K's distribution, as dp-accounting reads it: inf -> Poisson(mean) (K = 0 possible:
the study releases nothing), 0 -> logarithmic, 1 -> geometric, any other eta > 0 -> the truncated
negative binomial with shape eta; the distribution's parameter gamma follows from (eta, mean) as in
dp-accounting (`tnb_gamma`).
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from dpbench.errors import UserError


def entropy_rng() -> np.random.Generator:
    """A generator seeded from the OS's entropy pool, never from the run's `seed`."""
    return np.random.default_rng(secrets.randbits(128))


# ---------------------------------------------------------------------------------------------
# K, the random number of trials
# ---------------------------------------------------------------------------------------------


def parse_shape(value) -> float:
    """`shape` as a float; "inf"/".inf" (YAML's spelling, which Hydra's command line keeps as a string) -> inf."""
    if isinstance(value, str) and value.strip().lower().lstrip(".+") in ("inf", "infinity"):
        return math.inf
    try:
        shape = float(value)
    except (TypeError, ValueError):
        shape = math.nan
    if math.isnan(shape) or shape < 0:
        raise UserError(f"hydra.sweeper.shape={value}: the shape of the trial-count distribution must be >= 0 or inf "
                        "(0 logarithmic, 1 geometric, .inf Poisson)")
    return shape


def _check_distribution(mean: float, shape: float) -> None:
    if math.isnan(shape) or shape < 0:
        raise UserError(f"hydra.sweeper.shape={shape}: the shape of the trial-count distribution must be >= 0 or inf "
                        "(0 logarithmic, 1 geometric, .inf Poisson)")
    if not mean >= 1:  # dp-accounting's analysis needs it (and a geometric K has mean >= 1)
        raise UserError(f"hydra.sweeper.mean_trials={mean:g}: the mean number of trials must be at least 1")


def _tnb_mean(gamma: float, shape: float) -> float:
    """Mean of the truncated negative binomial of (gamma, eta) (Papernot & Steinke, Definition 1)."""
    if shape == 1:
        return 1 / gamma
    log_gamma = math.log(gamma)
    if gamma == 1:
        return 1.0
    if shape == 0:  # logarithmic: (1 - 1/gamma) / log(gamma)
        return (1 - 1 / gamma) / log_gamma
    # eta (1/gamma - 1) / (1 - gamma^eta), with expm1 for small eta log(gamma)
    return shape * (1 / gamma - 1) / -math.expm1(shape * log_gamma)


@functools.lru_cache(maxsize=256)
def tnb_gamma(shape: float, mean: float, tolerance: float = 1e-9) -> float:
    """gamma of the truncated negative binomial with shape eta and the given mean, found as
    dp-accounting finds it (`_gamma_truncated_negative_binomial`: geometric 1/mean, otherwise a
    bisection returning its lower end, i.e. a mean at least the asked one). Drawing K from another
    gamma than the one the accountant assumed would void the bound."""
    _check_distribution(mean, shape)
    if shape == 1:
        return 1 / mean
    low, high = 0.0, min(1.0, 2 * (shape + 1) / mean)
    while high > low * (1 + tolerance):
        gamma = (low + high) / 2
        if _tnb_mean(gamma, shape) < mean:
            high = gamma
        else:
            low = gamma
    return low


def trial_count_pmf(k: int, mean: float, shape: float) -> float:
    """P(K = k) of the distribution `draw_trial_count` samples (for checks and tests)."""
    shape = parse_shape(shape)
    _check_distribution(mean, shape)
    if shape == math.inf:
        return math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1))
    if k < 1:
        return 0.0
    gamma = tnb_gamma(shape, mean)
    if shape == 0:  # (1-gamma)^k / (k log(1/gamma))
        return math.exp(k * math.log1p(-gamma) - math.log(k) - math.log(-math.log(gamma)))
    # (1-gamma)^k / (gamma^-eta - 1) * prod_{l<k} (l + eta)/(l + 1)
    log_prod = math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1)
    return math.exp(k * math.log1p(-gamma) + log_prod - math.log(math.expm1(-shape * math.log(gamma))))


def draw_trial_count(mean: float, shape: float, rng: np.random.Generator | None = None) -> int:
    """K, the number of trials of a study: Poisson(mean) for shape=inf (0 allowed: the study then
    releases nothing, and K is never drawn again), otherwise the truncated negative binomial of
    dp-accounting's (shape, mean) (0: logarithmic, 1: geometric), K >= 1.

    K must come from fresh entropy (the default `rng`), never from the run's `seed`: the bound holds
    for K drawn independently of everything an adversary could know or steer. A seeded K is known
    in advance (and can be re-drawn by changing the seed until it suits), which turns the study
    into a fixed number of trials, whose cost is the composition (`naive_epsilon`), not this bound.
    Tests may pass their own `rng`.
    """
    shape = parse_shape(shape)
    _check_distribution(mean, shape)
    rng = entropy_rng() if rng is None else rng
    if shape == math.inf:
        return int(rng.poisson(mean))
    gamma = tnb_gamma(shape, mean)
    if gamma >= 1:
        return 1
    # Inversion of the CDF with the pmf's ratio P(k+1)/P(k) = (1-gamma)(k+eta)/(k+1): one uniform
    # draw, exact for every eta >= 0 (numpy's negative_binomial would need rejection of 0, which is
    # slow for small eta, and has no eta = 0).
    u = rng.random()
    k, p = 1, trial_count_pmf(1, mean, shape)
    cumulative = p
    while cumulative <= u:
        p *= (1 - gamma) * (k + shape) / (k + 1)
        k += 1
        cumulative += p
        if p < 1e-18 * cumulative:  # rounding left u above the summed mass: the far tail
            break
    return k


# ---------------------------------------------------------------------------------------------
# Selection: the hook where the validation score plugs in
# ---------------------------------------------------------------------------------------------


@dataclass
class TrialOutcome:
    """What a trial of a study returned. `score` is the job's return value (dpbench.cli.objective:
    the metric `optimize` names, "-key" negated, so higher is better); -inf for a trial that
    failed, diverged or returned no number."""

    index: int
    overrides: list[str] = field(default_factory=list)
    score: float = -math.inf
    status: str = "completed"  # completed | diverged | failed
    run_dir: str = ""

    def to_json(self) -> dict:
        return {"index": self.index, "overrides": self.overrides,
                "score": self.score if math.isfinite(self.score) else None, "status": self.status, "run_dir": self.run_dir}

    @classmethod
    def from_json(cls, data: dict) -> "TrialOutcome":
        score = data.get("score")
        return cls(int(data["index"]), list(data.get("overrides") or []), -math.inf if score is None else float(score),
                   str(data.get("status", "completed")), str(data.get("run_dir", "")))


def selected_trial(outcomes: Iterable[TrialOutcome]) -> TrialOutcome | None:
    """The trial a study releases: the highest finite score (the lowest index among equals); None
    when no trial has one (K = 0, or every trial failed).

    The bound covers any selection that reads only the trials' outputs (their noisy validation
    scores, each charged in its trial's own ledger), so the rule may change here."""
    finite = [o for o in outcomes if math.isfinite(o.score)]
    return max(finite, key=lambda o: (o.score, -o.index)) if finite else None


def trial_outcome(index: int, overrides: list[str], run_dir: Path, returned=None) -> TrialOutcome:
    """A trial's outcome from what its job returned (None: not launched, e.g. a failed trial found
    on resume) and its folder: no results.json, a status other than completed, or no finite
    return value all score -inf."""
    from dpbench.logging.results import read_results

    score = math.nan
    if returned is not None:
        try:
            score = float(returned.return_value)  # raises the job's exception when it failed
        except Exception:  # noqa: BLE001 - a trial that raised scores -inf, like one that diverged
            score = math.nan
    results = read_results(run_dir)
    if results is None:
        return TrialOutcome(index, overrides, -math.inf, "failed", str(run_dir))
    status = str(results.get("status") or "failed")  # a diverged trial wrote results.json, and returned nan
    if status != "completed" or not math.isfinite(score):
        return TrialOutcome(index, overrides, -math.inf, status if status != "completed" else "failed", str(run_dir))
    return TrialOutcome(index, overrides, score, status, str(run_dir))

"""The one-run lower bound on epsilon (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023): from v correct guesses out of r about m canaries, the largest epsilon
refuted at confidence 1 - c, and the guesses themselves (fixed from the scores alone)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _logistic(epsilon: float) -> float:
    return 1.0 / (1.0 + math.exp(-epsilon))


def one_run_p_value(epsilon: float, delta: float, m: int, r: int, v: int) -> float:
    """P-value of v correct guesses out of r (m canaries) under (epsilon, delta)-DP.

    p = e^eps / (1 + e^eps), beta = P[Binomial(r, p) >= v]; delta = 0: beta; otherwise
    min(1, beta + 2 m delta alpha) with alpha = max_{i=1..v} (P[Binomial(r, p) >= v - i] - beta) / i
    (Steinke, Nasr, Jagielski 2023, Theorem 3.1 / Proposition 5.3)."""
    from scipy.stats import binom

    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = _logistic(epsilon)
    beta = float(binom.sf(v - 1, r, p))  # P[X >= v]
    if delta == 0 or v == 0:
        return beta
    i = np.arange(1, v + 1)
    alpha = float(np.max((binom.sf(v - i - 1, r, p) - beta) / i))
    return min(1.0, beta + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95,
                        tolerance: float = 1e-6) -> float:
    """The largest epsilon whose p-value is still <= 1 - confidence (bisection: the p-value grows
    with epsilon); 0 when even epsilon = 0 is not rejected."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    c = 1 - confidence
    if one_run_p_value(0.0, delta, m, r, v) > c:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(high, delta, m, r, v) <= c:  # bracket: double until epsilon is no longer rejected
        low, high = high, 2 * high
        if high > 1e3:
            return math.inf  # not reached by any r <= m this code is used for
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if one_run_p_value(mid, delta, m, r, v) <= c else (low, mid)
    return low


def ceiling(m: int, r: int, delta: float, confidence: float = 0.95) -> float:
    """The bound when all r guesses are right: the most an audit with m canaries and r guesses can certify."""
    return epsilon_lower_bound(m, r, r, delta, confidence)


@dataclass
class Guesses:
    """The guesses made from the scores (fixed before they are compared with the inclusions)."""

    guessed_in: np.ndarray  # canary ids guessed "in": the G/2 highest scores
    guessed_out: np.ndarray  # canary ids guessed "out": the G/2 lowest scores

    @classmethod
    def from_scores(cls, scores: np.ndarray, guesses: int) -> "Guesses":
        order = np.argsort(scores, kind="stable")  # ties broken by canary id, which is independent of inclusion
        half = guesses // 2
        return cls(guessed_in=order[len(order) - half:], guessed_out=order[:half])

    def correct(self, included: np.ndarray) -> int:
        return int(included[self.guessed_in].sum() + (~included[self.guessed_out]).sum())

"""The privacy of a hyperparameter study: K random trials, only the best one released.

A grid or an Optuna sweep over private runs trains on the same private data once per trial, and
each trial spends the run's epsilon again: K trials composed cost about K times one (`naive_epsilon`).
Papernot & Steinke ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022) show that
when the NUMBER of trials K is itself random, drawn from a suitable distribution, and only the best
trial is released (its hyperparameters, model and score), the whole study costs little more than
one trial (`study_epsilon`). dp-accounting implements their bound as
`dp_event.RepeatAndSelectDpEvent(event, mean, shape)` under its RDP accountant; this module wraps it:

    event = trial_event(ledger)                        # one trial's releases (results.json privacy.ledger)
    study_epsilon(event, mean_trials=10, shape=1, delta=1e-5)   # the study, K ~ geometric of mean 10
    naive_epsilon(event, trials=10, delta=1e-5)        # what 10 trials composed would cost
    k = draw_trial_count(mean=10, shape=1)             # K for a study, from OS entropy

K, its distribution and the selection live in trials.py; the sweep that runs a study in sweep.py,
behind the Hydra sweeper hydra_plugins/dpbench_private_search (`dpbench -m hydra/sweeper=private_search ...`).

What the bound needs: every trial is the same mechanism (same ledger: only keys that leave the
ledger alone, such as lr and clip norm, may vary), trials do not read each other's results, K is
drawn with fresh randomness nobody can predict or re-draw, and only the selected trial is published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from dpbench.errors import UserError
from dpbench.privacy.accountants import MAX_NOISE_MULTIPLIER, smallest_noise_multiplier
from dpbench.privacy.events import as_ledger, ledger_dp_event  # noqa: F401  (the one ledger -> dp-accounting conversion)
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.study.trials import _check_distribution, parse_shape


# ---------------------------------------------------------------------------------------------
# A trial's privacy event
# ---------------------------------------------------------------------------------------------


def trial_event(ledger: Ledger | Iterable[dict] | Iterable[GaussianMechanism], score_noise_multiplier: float | None = None):
    """One trial's privacy event: its training ledger, and, with `score_noise_multiplier` sigma_v,
    the release of a validation score of L2 sensitivity 1 with Gaussian noise of std sigma_v (not
    subsampled): ComposedDpEvent([training, GaussianDpEvent(sigma_v)]). The score's sensitivity must
    be 1 under the ledger's relation (a count of correct predictions on private examples is)."""
    import dp_accounting as dpa

    training = ledger_dp_event(ledger)
    if score_noise_multiplier is None:
        return training
    if not score_noise_multiplier > 0:
        raise ValueError(f"the validation score's noise multiplier must be positive, got {score_noise_multiplier}")
    return dpa.ComposedDpEvent([training, dpa.GaussianDpEvent(score_noise_multiplier)])


@dataclass(frozen=True)
class ParallelEvent:
    """Releases that read disjoint parts of the data, each record in one part by a function of the
    record alone (the validation split), under add/remove neighbours: a record added or removed
    changes the input of one part only, so the RDP of the whole is the pointwise MAXIMUM of the
    parts' RDP curves (parallel composition; dp-accounting has no event for it, so `rdp_curve`
    takes the maximum over its curves). Under replace-one a record can move between the parts:
    never parallel."""

    events: tuple


def parallel_trial_event(training: Ledger | Iterable[dict], score_noise_multiplier: float) -> ParallelEvent:
    """One trial with privacy.validation_composition=parallel: its training ledger (without the score)
    and the noisy validation score of sensitivity 1 (GaussianDpEvent(sigma_v)), composed in parallel."""
    import dp_accounting as dpa

    if not score_noise_multiplier > 0:
        raise ValueError(f"the validation score's noise multiplier must be positive, got {score_noise_multiplier}")
    return ParallelEvent((ledger_dp_event(training), dpa.GaussianDpEvent(score_noise_multiplier)))


def same_ledger(a: Ledger, b: Ledger, rel_tol: float = 1e-9) -> bool:
    """Whether two ledgers hold the same mechanisms as often (up to rounding of sigma and q)."""
    ra, rb = a.as_records(), b.as_records()
    return len(ra) == len(rb) and all(
        x["neighboring"] == y["neighboring"] and x["count"] == y["count"]
        and math.isclose(x["noise_multiplier"], y["noise_multiplier"], rel_tol=rel_tol)
        and math.isclose(x["sample_rate"], y["sample_rate"], rel_tol=rel_tol)
        for x, y in zip(ra, rb)
    )


def ledger_within(recorded: Ledger | Iterable[dict], planned: Ledger, rel_tol: float = 1e-9) -> bool:
    """Whether a trial released at most its plan: the same mechanisms, none more often (a trial
    that diverged stopped early). The study's epsilon is computed from the plan."""
    plan = planned.items()
    for m, n in as_ledger(recorded).items():
        matches = [c for p, c in plan if p.neighboring == m.neighboring
                   and math.isclose(p.noise_multiplier, m.noise_multiplier, rel_tol=rel_tol)
                   and math.isclose(p.sample_rate, m.sample_rate, rel_tol=rel_tol)]
        if not matches or max(matches) < n:
            return False
    return True

# ---------------------------------------------------------------------------------------------
# Epsilons
# ---------------------------------------------------------------------------------------------


def _empty(event) -> bool:
    import dp_accounting as dpa

    if isinstance(event, ParallelEvent):
        return all(_empty(e) for e in event.events)
    if isinstance(event, dpa.NoOpDpEvent):
        return True
    if isinstance(event, dpa.ComposedDpEvent):
        return all(_empty(e) for e in event.events)
    if isinstance(event, dpa.SelfComposedDpEvent):
        return event.count == 0 or _empty(event.event)
    return False


def _orders():
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return np.array(DEFAULT_RDP_ORDERS, dtype=np.float64)


def _rdp_accountant(event):
    """dp-accounting's RDP accountant (add/remove, its default orders) with `event` composed."""
    import logging

    import dp_accounting as dpa

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    accountant = dpa.rdp.RdpAccountant(_orders(), neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return accountant.compose(event)


def rdp_curve(event) -> np.ndarray:
    """The event's RDP at dp-accounting's default orders (add/remove); a ParallelEvent's is the
    pointwise maximum of its parts' curves."""
    if isinstance(event, ParallelEvent):
        return np.max([rdp_curve(part) for part in event.events], axis=0)
    return _rdp_accountant(event).rdp


def _epsilon_of_curve(curve: np.ndarray, delta: float) -> float:
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(_orders(), curve, delta)[0])


def rdp_epsilon(event, delta: float) -> float:
    """epsilon of an event by dp-accounting's RDP accountant (add/remove neighbours)."""
    if isinstance(event, ParallelEvent):
        return _epsilon_of_curve(rdp_curve(event), delta)
    return float(_rdp_accountant(event).get_epsilon(delta))


def study_epsilon(event, mean_trials: float, shape: float, delta: float, studies: int = 1) -> float:
    """epsilon of the whole study: K ~ (mean_trials, shape) runs of `event`, only the best released
    (RepeatAndSelectDpEvent, RDP). Covers the selected trial's outputs, not the realised K.
    `studies` > 1: that many such studies on the same data, composed in RDP (below studies x one)."""
    from dp_accounting import dp_event

    shape = parse_shape(shape)
    _check_distribution(mean_trials, shape)
    if _empty(event) or studies <= 0:  # trials that release nothing: nothing to select from privately
        return 0.0
    if isinstance(event, ParallelEvent):
        # RepeatAndSelectDpEvent's own RDP transform, applied to the parallel curve (dp-accounting has
        # no event to carry that curve; tests check this path against RepeatAndSelectDpEvent)
        from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_repeat_and_select

        curve = np.asarray(_compute_rdp_repeat_and_select(_orders(), rdp_curve(event), float(mean_trials), shape))
        return _epsilon_of_curve(int(studies) * curve, delta)
    one = dp_event.RepeatAndSelectDpEvent(event, float(mean_trials), shape)
    return rdp_epsilon(one if studies == 1 else dp_event.SelfComposedDpEvent(one, int(studies)), delta)


def naive_epsilon(event, trials: int, delta: float) -> float:
    """epsilon of `trials` runs of `event` composed (what releasing all of them, or a fixed number
    of trials, costs): the comparison figure."""
    import dp_accounting as dpa

    if trials <= 0 or _empty(event):
        return 0.0
    if isinstance(event, ParallelEvent):
        return _epsilon_of_curve(int(trials) * rdp_curve(event), delta)
    return rdp_epsilon(dpa.SelfComposedDpEvent(event, int(trials)), delta)


def grid_selection_epsilon(ledgers: list, delta: float) -> float:
    """epsilon of selecting among a fixed set of runs (a basic grid) by their noisy validation
    scores: a fixed K, so every run's ledger (its noisy score included) composes (the study bound
    needs a random K): RDP over ComposedDpEvent of the runs' events."""
    import dp_accounting as dpa

    events = [trial_event(ledger) for ledger in ledgers]
    return 0.0 if not events else rdp_epsilon(dpa.ComposedDpEvent(events), delta)


def _bisect_sigma(epsilon_of: Callable[[float], float], target: float, what: str, tolerance: float) -> float:
    """Smallest sigma meeting the study's target: the calibration's own bisection."""
    return smallest_noise_multiplier(epsilon_of, target, tolerance,
                                     f"no {what} noise multiplier up to {MAX_NOISE_MULTIPLIER:g} meets epsilon={target}: "
                                     "raise the budget, lower mean_trials, or plan fewer steps")


def score_noise_multiplier_for_share(share: float, target_epsilon: float, delta: float, mean_trials: float,
                                     shape: float, tolerance: float = 0.005) -> float | None:
    """sigma_v of the validation score under the budget split rule: the noisy score ALONE, repeated
    and selected like the study, would cost `share` x target_epsilon. Training then gets the rest
    of the budget through `per_trial_noise_multiplier_for_budget`, which composes both (RDP
    composition is cheaper than splitting epsilon, so training gets more than (1 - share) x target).
    share = 0: no score release (None)."""
    import dp_accounting as dpa

    if not 0 <= share < 1:
        raise UserError(f"score_share must lie in [0, 1), got {share}")
    if share == 0:
        return None
    return _bisect_sigma(lambda s: study_epsilon(dpa.GaussianDpEvent(s), mean_trials, shape, delta),
                         share * target_epsilon, "validation-score", tolerance)


def per_trial_noise_multiplier_for_budget(event_for: Callable[[float], object], target_epsilon: float, delta: float,
                                          mean_trials: float, shape: float, score_alone: float | None = None,
                                          tolerance: float = 0.01) -> float:
    """Smallest per-trial sigma (within `tolerance` in epsilon) whose study meets the target:
    study_epsilon(event_for(sigma), ...) <= target_epsilon.

    `event_for(sigma)` is a trial's event at base noise multiplier sigma, its noisy validation
    score included, composed as the trial will (the sweeper plans it: `trial_event` of its ledger,
    or a ParallelEvent). `score_alone`: that score's noise multiplier sigma_v; a target the score
    alone already exceeds is refused in one line."""
    if score_alone is not None:
        alone = study_epsilon(trial_event([], score_alone), mean_trials, shape, delta)
        if alone >= target_epsilon:
            raise UserError(f"the validation score alone (noise multiplier {score_alone:g}) costs "
                            f"epsilon={alone:.3f} over the study, not below the target {target_epsilon}: "
                            "raise the budget or the score's noise (privacy.validation_noise_multiplier, or a lower score_share)")
    return _bisect_sigma(lambda s: study_epsilon(event_for(s), mean_trials, shape, delta),
                         target_epsilon, "per-trial", tolerance)

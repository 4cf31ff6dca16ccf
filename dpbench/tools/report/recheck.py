"""`dpbench-report --recheck RUN`: the epsilon of each results.json under RUN, recomputed from the
file alone with dp-accounting, beside the epsilon the run recorded.

The file's `privacy.dp_events` (dpbench/privacy/events.py; older files: `privacy.ledger`) are
rebuilt as dp-accounting events and composed by dp-accounting's PLD accountant (its interval
refined as dpbench's own pld refines it, `refined_pld`: the upper bound) and its
privacy-buckets optimistic estimate (the lower bound), and by its RDP accountant. A recorded
epsilon more than 1% below dp-accounting's PLD upper bound is flagged (exit status 1): it is not
a bound on what ran (gdp's approximation can be). No PLD grid larger than dpbench's pld allows
(`MAX_PLD_POINTS`) is built: a near-noiseless run gets a coarser lower bound, or none, and no verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dpbench.errors import UserError
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE, RunResults, read_results
from dpbench.privacy.accountants import PLDGridTooLarge

BELOW = 0.01  # a recorded epsilon this far below the tight one is flagged
OPTIMISTIC_INTERVAL = 1e-4  # the lower bound's grid


@dataclass
class Recheck:
    run: Path
    recorded: float | None
    accountant: str | None
    recorded_bounds: tuple[float | None, float | None]
    pld_lower: float | None  # None: no grid fits in memory
    pld_upper: float | None
    rdp: float | None
    delta: float
    source: str  # dp_events | ledger

    @property
    def consistent(self) -> bool:
        """False only where the recorded epsilon is below PLD's upper bound (none where no grid fits)."""
        return self.recorded is not None and (self.pld_upper is None or self.recorded >= self.pld_upper * (1 - BELOW))


def _events(privacy) -> tuple[list, object, bool, str]:
    """(events, relation, parallel, source) of a results.json privacy section."""
    import dp_accounting as dpa

    from dpbench.privacy.events import event_from_json, events_record
    from dpbench.privacy.mechanisms import Ledger

    record, source = privacy.dp_events, "dp_events"
    if not record:
        if privacy.ledger is None:
            raise UserError("its results.json holds neither privacy.dp_events nor privacy.ledger")
        record, source = events_record([Ledger.from_records(privacy.ledger)]), "ledger"
    relation = getattr(dpa.NeighboringRelation, record["neighboring_relation"])
    return [event_from_json(e) for e in record["events"]], relation, record["composition"] == "parallel", source


def pld_upper_bound(event, relation, delta: float) -> float:
    """dp-accounting's PLD accountant on the event, its interval refined as dpbench's pld refines its own."""
    import dp_accounting as dpa

    from dpbench.privacy.accountants import check_pld_grids, refined_pld

    mechanisms = _mechanisms_of(event)

    def epsilon_at(interval: float) -> float:
        check_pld_grids(relation, mechanisms, interval)  # a near-noiseless run's grid may not fit in memory
        return float(dpa.pld.PLDAccountant(relation, value_discretization_interval=interval).compose(event).get_epsilon(delta))

    return refined_pld(epsilon_at)[1]


def _mechanisms_of(event) -> tuple:
    """((sigma, sample rate), count) of each Gaussian in the event, the form dpbench's pld sizes grids by."""
    import dp_accounting as dpa

    if isinstance(event, dpa.ComposedDpEvent):
        return tuple(m for e in event.events for m in _mechanisms_of(e))
    if isinstance(event, dpa.SelfComposedDpEvent):
        return tuple((m, n * event.count) for m, n in _mechanisms_of(event.event))
    q, gaussian = (event.sampling_probability, event.event) if isinstance(event, dpa.PoissonSampledDpEvent) else (1.0, event)
    if not isinstance(gaussian, dpa.GaussianDpEvent):
        raise UserError(f"--recheck reads Gaussian events only, got {type(gaussian).__name__}")
    return (((float(gaussian.noise_multiplier), float(q)), 1),)


def _optimistic_pld(event, relation, interval: float):
    """dp-accounting's optimistic (privacy buckets) PLD of a composition of subsampled Gaussians."""
    import dp_accounting as dpa
    from dp_accounting.pld import privacy_loss_distribution as pld

    if isinstance(event, dpa.ComposedDpEvent):
        parts = [_optimistic_pld(e, relation, interval) for e in event.events]
        parts = [p for p in parts if p is not None]
        out = parts[0] if parts else None
        for p in parts[1:]:
            out = out.compose(p)
        return out
    if isinstance(event, dpa.SelfComposedDpEvent):
        one = _optimistic_pld(event.event, relation, interval)
        return one.self_compose(event.count) if one is not None and event.count > 0 else None
    q, gaussian = (event.sampling_probability, event.event) if isinstance(event, dpa.PoissonSampledDpEvent) else (1.0, event)
    if not isinstance(gaussian, dpa.GaussianDpEvent):
        raise UserError(f"--recheck reads Gaussian events only, got {type(gaussian).__name__}")
    return pld.from_gaussian_mechanism(gaussian.noise_multiplier, sampling_prob=q, value_discretization_interval=interval,
                                       pessimistic_estimate=False, use_connect_dots=False, neighboring_relation=relation)


def _lower_bound(event, relation, delta: float) -> float | None:
    """The optimistic PLD's epsilon at OPTIMISTIC_INTERVAL, or the finest coarser grid that fits in
    memory (a coarser optimistic grid is still a lower bound); None where none fits."""
    from dpbench.privacy.accountants import PLD_INTERVALS, check_pld_grids

    mechanisms = _mechanisms_of(event)
    for interval in sorted({OPTIMISTIC_INTERVAL, *[i for i in PLD_INTERVALS if i > OPTIMISTIC_INTERVAL]}):
        try:
            check_pld_grids(relation, mechanisms, interval)
        except PLDGridTooLarge:
            continue
        optimistic = _optimistic_pld(event, relation, interval)
        return 0.0 if optimistic is None else float(optimistic.get_epsilon_for_delta(delta))
    return None


def _rdp(event, relation, delta: float) -> float | None:
    import logging

    import dp_accounting as dpa

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter

    try:
        return float(dpa.rdp.RdpAccountant(neighboring_relation=relation).compose(event).get_epsilon(delta))
    except Exception:  # dp-accounting's RDP has no replace-one analysis of Poisson sampling
        return None


def recheck_run(path: Path) -> Recheck:
    results = RunResults.from_json(read_results(path.parent))
    privacy = results.privacy
    if not privacy.is_private or privacy.delta is None:
        raise UserError(f"{path} is not a private run: nothing to recheck")
    events, relation, parallel, source = _events(privacy)
    delta = float(privacy.delta)
    pick = max if parallel else (lambda values: values[0])
    if not parallel:
        import dp_accounting as dpa

        events = [dpa.ComposedDpEvent(events)]
    try:
        upper = pick([pld_upper_bound(e, relation, delta) for e in events])
    except PLDGridTooLarge:  # not even the coarsest grid fits: no PLD verdict, RDP's bound below
        upper = None
    lowers = [_lower_bound(e, relation, delta) for e in events]
    rdps = [_rdp(e, relation, delta) for e in events]
    return Recheck(path.parent, privacy.epsilon, privacy.accountant, (privacy.epsilon_lower, privacy.epsilon_upper),
                   None if None in lowers else pick(lowers), upper, None if None in rdps else pick(rdps), delta, source)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def recheck(folder: Path) -> int:
    """Print each run's recorded epsilon beside dp-accounting's; 1 if one is below the tight bound."""
    files = [folder / RESULTS_FILE] if (folder / RESULTS_FILE).is_file() else sorted(folder.rglob(RESULTS_FILE))
    if not files:
        raise UserError(f"no {RESULTS_FILE} under {folder}: pass a run folder")
    status = 0
    for path in files:
        r = recheck_run(path)
        lower, upper = r.recorded_bounds
        verdict = "consistent" if r.consistent else f"BELOW dp-accounting's PLD by more than {BELOW:.0%}: not a bound"
        if r.pld_upper is None and r.recorded is not None:  # a near-noiseless run: RDP (two libraries' orders) only
            verdict = "not re-checked by PLD (no grid fits in memory)"
        console.print(
            f"{r.run}: recorded epsilon {_fmt(r.recorded)} by {r.accountant} (lower {_fmt(lower)}, upper {_fmt(upper)}); "
            f"dp-accounting from {r.source}: PLD lower {_fmt(r.pld_lower)}, upper {_fmt(r.pld_upper)}, RDP {_fmt(r.rdp)} "
            f"at delta {r.delta:g}: {verdict}", soft_wrap=True, highlight=False)
        status = status or (0 if r.consistent else 1)
    return status

"""The ledger as dp-accounting events: what the pld accountant composes and what results.json records.

A third party re-accounts a run from `privacy.dp_events` alone (`dpbench-report --recheck RUN`):

    {"format": "dp_accounting.DpEvent.to_named_tuple",      # each event as its named tuple, JSON
     "neighboring_relation": "ADD_OR_REMOVE_ONE",            # dp_accounting.NeighboringRelation
     "composition": "sequential",                            # | parallel: epsilon = max over events
     "events": [{"module_name": "dp_accounting.dp_event", "class_name": "ComposedDpEvent", "events": [...]}]}

Each (mechanism, count) of the ledger is SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),
count). Under add/remove (or a mixed ledger) a replace-one mechanism enters at sigma/2
(`GaussianMechanism.add_remove_noise_multiplier`); a ledger stated under replace-one only keeps each
sigma under dp-accounting's REPLACE_ONE relation (exact). `event_from_json` rebuilds the events with
dp-accounting's own classes: `dp_accounting.pld.PLDAccountant(relation).compose(event)` gives epsilon.
"""

from __future__ import annotations

import importlib
from typing import Iterable, NamedTuple

from dpbench.privacy.mechanisms import GaussianMechanism, Ledger

EVENTS_FORMAT = "dp_accounting.DpEvent.to_named_tuple"


class AccountedLedger(NamedTuple):
    """The ledger as the pld accountant composes it: one relation, (sigma, q) of each mechanism."""

    relation: object  # dp_accounting.NeighboringRelation
    mechanisms: list  # [((sigma, q), count)]


def accounted_ledger(ledger: Ledger) -> AccountedLedger:
    """Replace-one exactly when every mechanism is stated under it, else add/remove at sigma/2."""
    import dp_accounting as dpa

    items = ledger.items()
    if items and all(m.neighboring == "replace_one" for m, _ in items):
        return AccountedLedger(dpa.NeighboringRelation.REPLACE_ONE, [((m.noise_multiplier, m.sample_rate), n) for m, n in items])
    return AccountedLedger(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                           [((m.add_remove_noise_multiplier, m.sample_rate), n) for m, n in items])


def as_ledger(ledger: Ledger | Iterable[dict] | Iterable[GaussianMechanism]) -> Ledger:
    """A Ledger from a Ledger, its `as_records()` (results.json privacy.ledger) or a list of the
    mechanisms that ran (one entry per release)."""
    if isinstance(ledger, Ledger):
        return ledger
    items = list(ledger)
    if all(isinstance(item, GaussianMechanism) for item in items):
        out = Ledger()
        out.extend(items)
        return out
    return Ledger.from_records(items)


def ledger_dp_event(ledger: Ledger | Iterable[dict] | Iterable[GaussianMechanism], exact_replace_one: bool = False):
    """The ledger as one dp-accounting event: each (mechanism, count) a self-composed
    Poisson-subsampled Gaussian.

    Under add/remove (default) a replace-one mechanism enters at sigma/2, the conservative reduction
    dpbench's rdp/prv/gdp accountants use (`GaussianMechanism.add_remove_noise_multiplier` says why).
    `exact_replace_one`: a ledger stated under replace-one only, with each mechanism's own sigma, for
    an accountant built with dp-accounting's REPLACE_ONE relation (PLD; its RDP has no
    replace-one analysis of Poisson sampling). A noiseless mechanism is a NonPrivateDpEvent."""
    import dp_accounting as dpa

    items = as_ledger(ledger).items()
    if exact_replace_one and any(m.neighboring != "replace_one" for m, _ in items):
        raise ValueError("exact_replace_one needs a ledger stated under replace_one only")
    events = []
    for m, count in items:
        sigma = m.noise_multiplier if exact_replace_one else m.add_remove_noise_multiplier
        step = dpa.PoissonSampledDpEvent(m.sample_rate, dpa.GaussianDpEvent(sigma)) if sigma > 0 else dpa.NonPrivateDpEvent()
        events.append(dpa.SelfComposedDpEvent(step, count))
    return dpa.ComposedDpEvent(events)


def event_to_json(event) -> dict:
    """A DpEvent as plain JSON data: its `to_named_tuple()` (module_name, class_name, fields), nested."""
    def plain(value):
        if hasattr(value, "_asdict"):
            return {key: plain(v) for key, v in value._asdict().items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(event.to_named_tuple())


def event_from_json(data):
    """The DpEvent `event_to_json` wrote, built with dp-accounting's own classes."""
    if isinstance(data, list):
        return [event_from_json(v) for v in data]
    if not isinstance(data, dict) or "class_name" not in data:
        return data
    module = data.get("module_name", "dp_accounting.dp_event")
    if module.split(".")[0] != "dp_accounting":
        raise ValueError(f"not a dp_accounting event: {module}.{data['class_name']}")
    cls = getattr(importlib.import_module(module), data["class_name"])
    return cls(**{k: event_from_json(v) for k, v in data.items() if k not in ("module_name", "class_name")})


def events_record(parts: list[Ledger], parallel: bool = False) -> dict:
    """results.json privacy.dp_events for the ledger (`parts` = [ledger]), or for parts composed in
    parallel (training and the validation score under privacy.validation_composition=parallel)."""
    parts = [part for part in parts if part] or [Ledger()]
    relations = {accounted_ledger(part).relation for part in parts}
    relation = relations.pop() if len(relations) == 1 else None
    exact = relation is not None and relation.name == "REPLACE_ONE"
    if relation is None:  # parts under different relations: all through add/remove
        import dp_accounting as dpa

        relation, exact = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, False
    return {
        "format": EVENTS_FORMAT,
        "neighboring_relation": relation.name,
        "composition": "parallel" if parallel else "sequential",
        "events": [event_to_json(ledger_dp_event(part, exact_replace_one=exact)) for part in parts],
    }

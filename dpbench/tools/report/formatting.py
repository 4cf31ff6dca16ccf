"""How the report writes numbers: one dash for a missing value, ∞ for the ε of a non-private run."""

from __future__ import annotations

import math

INFINITY = "∞"


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def fmt_any(value) -> str:
    if value is None:
        return "—"
    return format(value, "g") if isinstance(value, float) else str(value)


def fmt_eps(value, spec: str = "g") -> str:
    """Non-private runs show ∞ everywhere (target and spent)."""
    return INFINITY if value is None or value == math.inf else format(value, spec)


def fmt_bound(value, spec: str = ".2f") -> str:
    """An audit's bound on ε: a dash when there is none, ∞ when nothing bounds it."""
    if value is None:
        return "—"
    return INFINITY if value == math.inf else format(value, spec)

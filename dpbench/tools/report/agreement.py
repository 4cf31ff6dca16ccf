"""Whether two leaderboards rank the same methods the same way: Kendall's τ (scipy's τ-b, which
counts ties) over the methods both boards carry, with its two-sided p-value."""

from __future__ import annotations

from dataclasses import dataclass

MIN_METHODS = 3  # fewer common methods: no ranking to compare


@dataclass(frozen=True)
class Agreement:
    tau: float
    p_value: float
    methods: tuple[str, ...]  # the methods both boards carry

    def describe(self) -> str:
        return f"Kendall's τ = {self.tau:.2f} over {len(self.methods)} methods (p = {self.p_value:.2g})"


def kendall(first: dict[str, float], second: dict[str, float]) -> Agreement | None:
    """τ between two {method: accuracy} maps, over their common methods; None below MIN_METHODS."""
    from scipy.stats import kendalltau

    common = tuple(sorted(set(first) & set(second)))
    if len(common) < MIN_METHODS:
        return None
    result = kendalltau([first[m] for m in common], [second[m] for m in common])
    return Agreement(float(result.statistic), float(result.pvalue), common)

"""The ledger: which noisy releases a run made, in the accountants' common language.

An algorithm declares, for each step, the subsampled Gaussian mechanisms it runs. A mechanism's
noise multiplier is the noise standard deviation divided by the L2 sensitivity of the released
sum under the add/remove-one neighbouring relation (Opacus's convention). The trainer appends
what each step actually ran; the accountant composes the ledger into epsilon.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class GaussianMechanism:
    noise_multiplier: float  # noise std / L2 sensitivity
    sample_rate: float  # Poisson sampling probability q of the batch it reads

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0:
            raise ValueError(f"noise multiplier must be positive, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample rate must lie in (0, 1], got {self.sample_rate}")


class Ledger:
    """A multiset of mechanisms: composition does not depend on their order."""

    def __init__(self) -> None:
        self.counts: Counter[GaussianMechanism] = Counter()

    def add(self, mechanism: GaussianMechanism, count: int = 1) -> None:
        if count > 0:
            self.counts[mechanism] += count

    def extend(self, mechanisms: list[GaussianMechanism]) -> None:
        for mechanism in mechanisms:
            self.add(mechanism)

    def __len__(self) -> int:
        return sum(self.counts.values())

    def __bool__(self) -> bool:
        return bool(self.counts)

    def items(self) -> list[tuple[GaussianMechanism, int]]:
        return sorted(self.counts.items(), key=lambda kv: (kv[0].noise_multiplier, kv[0].sample_rate))

    def as_records(self) -> list[dict]:
        return [
            {"noise_multiplier": m.noise_multiplier, "sample_rate": m.sample_rate, "count": n}
            for m, n in self.items()
        ]

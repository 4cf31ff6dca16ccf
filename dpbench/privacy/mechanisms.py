"""The ledger: which noisy releases a run made, in the accountants' common language.

An algorithm declares, for each step, the subsampled Gaussian mechanisms it runs. A mechanism's
noise multiplier is the noise standard deviation divided by the per-example L2 bound of the
released sum, i.e. its sensitivity under the add/remove-one neighbouring relation (Opacus's
convention). Its `neighboring` field says which relation the guarantee is stated for:
`add_remove` (default) or `replace_one` (substitution; the sum's sensitivity is then twice the
bound, as in the DPZero paper). The trainer appends what each step actually ran; the accountant
composes the ledger into epsilon.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

NEIGHBORING_RELATIONS = ("add_remove", "replace_one")


@dataclass(frozen=True)
class GaussianMechanism:
    noise_multiplier: float  # noise std / L2 sensitivity
    sample_rate: float  # Poisson sampling probability q of the batch it reads
    neighboring: str = "add_remove"  # relation the guarantee is stated for (NEIGHBORING_RELATIONS)

    def __post_init__(self) -> None:
        if self.neighboring not in NEIGHBORING_RELATIONS:
            raise ValueError(f"neighboring must be one of {NEIGHBORING_RELATIONS}, got {self.neighboring!r}")
        if not self.noise_multiplier >= 0:  # 0: a noiseless release (tests only); its epsilon is infinite
            raise ValueError(f"noise multiplier must be non-negative, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample rate must lie in (0, 1], got {self.sample_rate}")


    @property
    def add_remove_noise_multiplier(self) -> float:
        """Noise multiplier of an add/remove mechanism whose guarantee covers this one.

        replace_one -> sigma / 2, i.e. add/remove accounting at sensitivity 2C. Why this is sound
        per step: with Poisson rate q, the worst replace-one pair is P = qN(-C)+(1-q)N(0) vs
        Q = qN(C)+(1-q)N(0); by advanced joint convexity (Balle, Barthe, Gaboardi 2018, Thm 2)
        H_{g'}(P||Q) = q H_g(N(-C) || (1-b)N(0) + b N(C)) <= q H_g(N(-C)||N(C)) (convexity in the
        second argument; Gaussians at distance C are closer than at 2C), which is exactly the
        add/remove ("remove") hockey-stick divergence at sensitivity 2C. It is also what the DPZero
        code does (Opacus add/remove multiplier m, noise std 2mC). The rdp, prv and gdp
        accountants (Opacus: add/remove only) use it; the pld accountant accounts replace-one
        exactly with dp-accounting's REPLACE_ONE relation, and tests/test_dpzero.py checks that
        the reduction is never below that exact value.
        """
        return self.noise_multiplier if self.neighboring == "add_remove" else self.noise_multiplier / 2


def joint_noise_multiplier(parts: list[tuple[float, float]]) -> float:
    """Noise multiplier of one Gaussian mechanism releasing several parts of one batch.

    `parts` are (noise std, L2 sensitivity) pairs. Dividing each part by its noise std makes the
    joint release a Gaussian with unit noise and sensitivity sqrt(sum (sens/std)^2), so the
    release is a single mechanism with multiplier (sum (sens/std)^2)^-1/2 (DPDR's decomposition
    step; a single part gives std/sens).
    """
    if not parts:
        raise ValueError("a release needs at least one part")
    for std, sensitivity in parts:
        if not (std >= 0 and sensitivity > 0):
            raise ValueError(f"noise std must be >= 0 and sensitivity > 0, got {std} and {sensitivity}")
    if any(std == 0 for std, _ in parts):
        return 0.0  # a noiseless part releases everything
    return sum((sensitivity / std) ** 2 for std, sensitivity in parts) ** -0.5


def same_mechanisms(ran: list[GaussianMechanism], planned: list[GaussianMechanism], rel_tol: float = 1e-9) -> bool:
    """Whether a step ran exactly the planned mechanisms (as multisets, up to rounding)."""
    if len(ran) != len(planned):
        return False
    key = lambda m: (m.neighboring, m.sample_rate, m.noise_multiplier)  # noqa: E731
    for a, b in zip(sorted(ran, key=key), sorted(planned, key=key)):
        if a.neighboring != b.neighboring or not math.isclose(a.sample_rate, b.sample_rate, rel_tol=rel_tol):
            return False
        if not math.isclose(a.noise_multiplier, b.noise_multiplier, rel_tol=rel_tol):
            return False
    return True


def under_relation(mechanisms: list[GaussianMechanism], neighboring: str) -> list[GaussianMechanism]:
    """The same mechanisms with their guarantee stated under `neighboring`."""
    return [replace(m, neighboring=neighboring) for m in mechanisms]


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
            {"noise_multiplier": m.noise_multiplier, "sample_rate": m.sample_rate, "neighboring": m.neighboring, "count": n}
            for m, n in self.items()
        ]

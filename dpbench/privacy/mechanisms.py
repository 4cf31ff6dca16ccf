"""The ledger: which noisy releases a run made, in the accountants' common language.

An algorithm declares, for each step, the subsampled Gaussian mechanisms it runs. A mechanism's
noise multiplier is the noise standard deviation divided by the per-example L2 bound of the
released sum, i.e. its sensitivity under the add/remove-one neighbouring relation (Opacus's
convention). Its `neighboring` field says which relation the guarantee is stated for:
`add_remove` (default) or `replace_one` (substitution; the sum's sensitivity is then twice the
bound, as in the DPZero paper). The trainer appends what each step actually ran; the accountant
composes the ledger into epsilon.

Shuffled fixed-size batches (`privacy.sampling=shuffle`) have no amplification by sampling: their
ledger (`ShuffledLedger`) holds one full-batch mechanism per epoch instead (see its docstring).
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
        exactly with dp-accounting's REPLACE_ONE relation, and tests/algorithms/test_dpzero.py checks that
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


def one_batch_mechanism(mechanisms: list[GaussianMechanism]) -> list[GaussianMechanism]:
    """The releases of one step, which read one sampled batch, as the ONE mechanism they are.

    An example is in the batch for all of them or for none, so they are not independently
    subsampled: whitened, the releases are one Gaussian of multiplier (sum sigma_j^-2)^-1/2 at the
    batch's sample rate (`joint_noise_multiplier`). Charging them as separate subsampled
    mechanisms understates epsilon (DC-DPSGD's histogram and gradient: 8 reported, 13.5 true at
    its MNIST preset). [] for a step that released nothing; a single release is returned as is.
    """
    if len(mechanisms) <= 1:
        return list(mechanisms)
    first = mechanisms[0]
    for m in mechanisms[1:]:
        if m.neighboring != first.neighboring or not math.isclose(m.sample_rate, first.sample_rate, rel_tol=1e-12):
            raise ValueError("releases of one step must read one batch under one relation: got "
                             f"{[(x.sample_rate, x.neighboring) for x in mechanisms]}")
    sigma = joint_noise_multiplier([(m.noise_multiplier, 1.0) for m in mechanisms])
    return [GaussianMechanism(sigma, first.sample_rate, first.neighboring)]


class SeveralMechanismsPerBatchError(ValueError):
    """A step declared more than one mechanism: releases that read one sampled batch are one
    mechanism (`one_batch_mechanism`); composing them as independent understates epsilon."""


def _one_per_step(mechanisms: list[GaussianMechanism]) -> None:
    if len(mechanisms) > 1:
        raise SeveralMechanismsPerBatchError(
            f"a step declared {len(mechanisms)} mechanisms on one sampled batch; they are one mechanism: "
            "combine them with dpbench.privacy.mechanisms.one_batch_mechanism")


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

    def add_step(self, mechanisms: list[GaussianMechanism]) -> None:
        """Record the release of one training step: at most one mechanism, since everything a step
        releases reads its one sampled batch (`one_batch_mechanism`); more is refused."""
        _one_per_step(mechanisms)
        self.extend(mechanisms)

    def add_release(self, mechanism: GaussianMechanism) -> None:
        """Record a release made outside the training steps that reads a fixed, not sampled, set
        (sample_rate 1: the validation score of the final model). It composes with the steps as
        one more mechanism (sequential composition), in a shuffled run's ledger too: it is no step
        of an epoch."""
        if mechanism.sample_rate != 1.0:
            raise ValueError(f"a release outside the steps reads no sampled batch: sample_rate 1, got {mechanism.sample_rate}")
        self.add(mechanism)

    def expanded(self) -> list[GaussianMechanism]:
        """Every mechanism as often as it counts (for comparisons with `same_mechanisms`)."""
        return [m for m, n in self.items() for _ in range(n)]

    @classmethod
    def from_records(cls, records: list[dict]) -> "Ledger":
        """A plain ledger holding `as_records()` (results.json, checkpoints)."""
        ledger = Ledger()
        for record in records:
            mechanism = GaussianMechanism(record["noise_multiplier"], record["sample_rate"], record["neighboring"])
            ledger.add(mechanism, record["count"])
        return ledger

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


def split_off(ledger: Ledger, mechanisms) -> tuple[Ledger, Ledger]:
    """(the rest, the taken): each of `mechanisms` taken once out of `ledger`'s multiset where it is
    there (a run's releases after training, composed in parallel: `PrivacyPlan.epsilon`). Both are
    plain ledgers of counts (what the accountants read)."""
    counts, taken = Counter(ledger.counts), Ledger()
    for mechanism in mechanisms:
        if counts[mechanism] > 0:
            counts[mechanism] -= 1
            taken.add(mechanism)
    rest = Ledger()
    for mechanism, n in counts.items():
        rest.add(mechanism, n)
    return rest, taken


def full_batch_mechanism(mechanisms: list[GaussianMechanism]) -> GaussianMechanism | None:
    """One step's releases read by an example whose batch is known: one Gaussian at q = 1, stated
    under replace-one (sensitivity 2C; see `ShuffledLedger` for why add/remove costs the same).

    Gaussian releases of one batch compose into one Gaussian whose multiplier is that of the
    whitened joint release, (sum sigma_j^-2)^-1/2 (`joint_noise_multiplier`). None: no release."""
    if not mechanisms:
        return None
    if len(mechanisms) == 1:  # (sigma^-2)^-1/2 would round sigma in its last bit
        return GaussianMechanism(mechanisms[0].noise_multiplier, 1.0, "replace_one")
    sigma = joint_noise_multiplier([(m.noise_multiplier, 1.0) for m in mechanisms])
    return GaussianMechanism(sigma, 1.0, "replace_one")


class ShuffledLedger(Ledger):
    """The ledger of fixed-size batches cut from a fresh random order of the data each epoch.

    Bound (no amplification; Chua et al., "How Private are DP-SGD Implementations?", ICML 2024):
    for any fixed sequence of orders, an example is in at most one batch of each epoch, and a step
    whose batch does not hold it releases the same distribution on both neighbours (given the
    past), so by adaptive composition the run costs one full-batch Gaussian per epoch: the
    releases of the step that holds it. The order is unknown, so each epoch is charged its worst
    step (smallest `full_batch_mechanism` multiplier; a partial epoch its worst step so far). The
    shuffled run is a mixture over orders drawn independently of the data with the same weights
    on both neighbours, and the hockey-stick divergence is jointly convex, so the bound for every
    fixed order holds for the mixture.

    Neighbours: replace-one (same size, one example differs) changes one batch of an epoch by a
    replacement: the clipped sum moves by at most 2C. Add/remove-one shifts a fixed-size partition,
    but coupling the orders (map an order of D + x to one of D by swapping x with the element in
    the last position and deleting it: uniform to uniform) again changes at most one batch per
    epoch by a replacement (x for the element that moved), provided that last position is never in
    a batch: kB <= |D|, the smaller set's size. k = (n - 1) // B batches of B for a data set of n
    meet it for both its neighbours, n - 1 and n + 1 (`dpbench.privacy.sampling.batches_per_epoch`).
    Where the realised data is smaller than the planned kB + 1 slots (a validation split took more
    than planned), the order runs over kB + 1 slots, the extra ones empty, for both neighbours: the
    added example fills an empty slot, a change of C in one batch (`ShuffledBatches`, `min_slots`).
    Both relations therefore charge each epoch a replace-one Gaussian (sensitivity 2C).
    """

    def __init__(self, batches_per_epoch: int) -> None:
        super().__init__()
        if batches_per_epoch < 1:
            raise ValueError(f"an epoch needs at least one batch, got {batches_per_epoch}")
        self.batches_per_epoch = batches_per_epoch
        self.steps = 0
        self._epoch_charge: GaussianMechanism | None = None  # what the current epoch is charged

    def add_step(self, mechanisms: list[GaussianMechanism]) -> None:
        if self.steps % self.batches_per_epoch == 0:
            self._epoch_charge = None  # a new epoch (a new order) begins
        _one_per_step(mechanisms)
        self.steps += 1
        step = full_batch_mechanism(mechanisms)
        charged = self._epoch_charge
        if step is None or (charged is not None and step.noise_multiplier >= charged.noise_multiplier):
            return
        if charged is not None:  # this step is the epoch's worst so far: it replaces the charge
            self.counts[charged] -= 1
            if not self.counts[charged]:
                del self.counts[charged]
        self.add(step)
        self._epoch_charge = step

    def extend(self, mechanisms: list[GaussianMechanism]) -> None:
        raise TypeError("a shuffled ledger is filled step by step: use add_step")


def new_ledger(batches_per_epoch: int | None = None) -> Ledger:
    """An empty ledger: Poisson batches (None) or shuffled batches of `batches_per_epoch` per epoch."""
    return Ledger() if batches_per_epoch is None else ShuffledLedger(batches_per_epoch)

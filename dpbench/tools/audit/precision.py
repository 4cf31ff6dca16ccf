"""The noise-precision check of `dpbench-audit` (dpbench/tools/audit/runner.py): the noise a release added
keeps fp32's precision. Noise drawn in fp32 but rounded to bf16 (or fp16) before it is added has
the right std and passes every other check, yet release - value lies on the narrow format's grid,
which lets an attacker tell neighbouring values apart (Mironov 2012's floating-point attack).

It measures the release, through the release observer: for every coordinate of every part with
noise, the residual r = release - value computed in the release's own dtype (fp32), and whether r
is exactly representable in bf16 or fp16. Only residuals that carry the noise's full precision are
counted ("informative"): the value is 0 (r is the noise itself), or |r| <= |value| <= 2 |r| (the
value dominates the sum, so a narrow noise survives it exactly, and r keeps >= 22 of fp32's 24
significant bits, so an fp32 draw is representable in fp16 with probability about 2^-11 and in
bf16 about 2^-14). A residual of exactly 0 is not noise (a release whose noise was added upstream,
per chunk) and is left out. The parameters are never looked at: bf16 weights are bf16 by design.

It also tests q = r / the stated std against the same grids: a standard normal drawn in bf16 (or
fp16) and then scaled by sigma C in fp32 has the right std and a residual of 24 significant bits,
but q is the narrow draw again, up to fp32 rounding (at most about 2^-22 of q where 4 |value| <= |r|:
only those residuals count). q counts as on a grid when it is within 2^-21 of q of one of its
points; an fp32 draw is, with probability about 0.02% (bf16) and 0.14% (fp16), measured.

And every noised TENSOR (`NullTally`, the "noise per tensor" row): no residual that carries no noise
(exactly 0, or not finite), beyond the few that fp32 rounding can explain. Noise skipped on small
tensors (a head's bias released exactly) vanishes in the pooled statistics, not here. A residual
rounds to exactly 0 only when the noise is below half the value's spacing, so its probability is at
most 0.8 spacing / std (summed over a tensor: `expected`); where the step's total noise is measured
against the engine's chunk sums (noise added per chunk, before a release that adds none), a zero
residual counts only if that total is also within the chunk sums' fp32 rounding (2^-20 of their
magnitude). A tensor fails when its null residuals exceed the count that rounding exceeds with
probability below 1e-9 (Chernoff): a deterministic row, outside the statistical family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpbench.tools.audit.report import NULL, PRECISION, Check

MAX_REPRESENTABLE = 0.01  # fail above 1% representable residuals; fp32 noise gives about 0.05%
MIN_INFORMATIVE = 200  # fewer informative residuals: too few to judge (the row says so and passes)
# residual / stated std: an fp32 draw lands within GRID_TOLERANCE of an fp16 point with probability about 2^-9.5
# (measured: 0.14%), so MIN_SCALED of them exceed 1% with probability below 1e-9 (Poisson(3) above 20)
GRID_TOLERANCE = 2.0**-21  # relative: about 4 x the fp32 rounding of a scaled narrow draw
MIN_SCALED = 2000
ROUNDING_BAND = 2.0**-20  # of |chunk sums| + |release|: fp32 rounding of <= 16 chunks added up
NULL_FALSE_ALARM = 1e-9  # a tensor's null residuals exceed their allowance by rounding at most this often
# torch's fp32 normal_ (Box-Muller on 24-bit uniforms) returns an exact 0 where its uniform is 0, for both
# normals of the pair: 2^-24 per pair in theory, 9 zeros in 1e8 draws measured; twice that as margin
SAMPLER_ZERO_PAIRS = 2.0**-23
# a tensor's exact-zero pairs exceed their allowance at most this often (per tensor; an audit has tens of
# tensors, a test a few audits: below 1e-4 a test); a 1e-9 allowance would admit one pair in a 4-entry tensor
SAMPLER_FALSE_ALARM = 1e-6


@dataclass
class PrecisionTally:
    """Per release part: informative residuals, and how many of them are on the bf16 / fp16 grid."""

    informative: int = 0
    bf16: int = 0
    fp16: int = 0
    dtypes: frozenset = frozenset()
    # residual / stated std (4 |value| <= |residual|): how many, and how many near the bf16 / fp16 grid
    scaled: int = 0
    scaled_bf16: int = 0
    scaled_fp16: int = 0

    def add(self, value: torch.Tensor, noisy: torch.Tensor, std: float = 0.0) -> None:
        noisy = noisy.detach()
        value = value.detach().to(noisy.dtype)
        residual = (noisy - value).flatten()  # in the release's dtype, as a reader of the release computes it
        value = value.flatten()
        keep = (residual != 0) & ((value == 0) | ((value.abs() >= residual.abs()) & (value.abs() <= 2 * residual.abs())))
        kept = residual[keep].float()
        self.informative += int(kept.numel())
        self.bf16 += int((kept.to(torch.bfloat16).float() == kept).sum())
        self.fp16 += int((kept.to(torch.float16).float() == kept).sum())
        self.dtypes = self.dtypes | {str(noisy.dtype).removeprefix("torch.")}
        if std > 0:
            finite = torch.isfinite(residual) & torch.isfinite(value)
            quotient = residual[finite & (residual != 0) & (4 * value.abs() <= residual.abs())].double() / std
            self.scaled += int(quotient.numel())
            self.scaled_bf16 += _near_grid(quotient, torch.bfloat16)
            self.scaled_fp16 += _near_grid(quotient, torch.float16)

    def shares(self) -> tuple[float, float]:
        """(share of informative residuals on a grid, share of residual / std near one), 0 where too few."""
        direct = max(self.bf16, self.fp16) / self.informative if self.informative >= MIN_INFORMATIVE else 0.0
        scaled = max(self.scaled_bf16, self.scaled_fp16) / self.scaled if self.scaled >= MIN_SCALED else 0.0
        return direct, scaled


def _near_grid(quotient: torch.Tensor, dtype: torch.dtype) -> int:
    """How many of `quotient` (float64) lie within GRID_TOLERANCE (relative) of a point of `dtype`'s grid."""
    nearest = quotient.to(dtype).double()
    return int(((quotient - nearest).abs() <= GRID_TOLERANCE * quotient.abs()).sum())


@dataclass
class NullTally:
    """One noised tensor of a release part: its residuals, those that carry no noise (exactly 0 or not
    finite), and the count fp32 rounding explains on average at most (`expected`)."""

    shape: tuple
    draws: int = 0
    null: int = 0
    nonfinite: int = 0
    expected: float = 0.0

    def add(self, value: torch.Tensor, noisy: torch.Tensor, std: float, reference: torch.Tensor | None = None,
            magnitude: torch.Tensor | None = None) -> None:
        """`reference`, `magnitude` (float64): the step's chunk sums as the engine formed them and the
        sum of their absolute values, where the step's total noise is measured (noise added per chunk)."""
        noisy = noisy.detach()
        value = value.detach().to(noisy.dtype)
        finite = torch.isfinite(noisy)
        null = (noisy - value) == 0  # in the release's dtype: only fp32 rounding of value + noise gives 0
        spacing = (torch.nextafter(value.abs(), torch.full_like(value, math.inf)) - value.abs()).double()
        chance = 0.8 * spacing.nan_to_num(0.0) / std  # P(|N(0, std)| <= spacing / 2) <= 0.8 spacing / std
        if reference is not None:
            band = ROUNDING_BAND * (magnitude + noisy.double().abs())
            null = null & ((noisy.double() - reference).abs() <= band).to(null.device)
            chance = chance + 1.2 * band.nan_to_num(0.0) / std  # |noise| <= 1.5 band
        self.draws += noisy.numel()
        self.null += int((null & finite).sum())
        self.nonfinite += int((~finite).sum())
        self.expected += float(chance.clamp(max=1.0).sum())

    def allowed(self) -> int:
        """The null count that fp32 rounding exceeds with probability below NULL_FALSE_ALARM, plus twice
        the count of the sampler's exact-zero pairs (SAMPLER_ZERO_PAIRS per pair of draws) exceeded with
        probability below SAMPLER_FALSE_ALARM (Chernoff: P(Z >= k) <= exp(-E) (e E / k)^k for k > E)."""
        pairs = self.draws / 2 * SAMPLER_ZERO_PAIRS
        return _chernoff_count(self.expected, NULL_FALSE_ALARM) + 2 * _chernoff_count(pairs, SAMPLER_FALSE_ALARM)

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.null <= self.allowed()


def _chernoff_count(e: float, alarm: float) -> int:
    """The smallest k that a sum of independent indicators of mean `e` exceeds with probability below `alarm`."""
    k = 0
    while k + 1 <= e or (e > 0 and -e + (k + 1) * (1 + math.log(e / (k + 1))) > math.log(alarm)):
        k += 1
    return k


def tally_release(tallies: dict[str, PrecisionTally], name: str, parts, noisy,
                  nulls: dict[str, list[NullTally]] | None = None, reference=None) -> None:
    """Add one observed release (the observer's parts and noisy values) to `tallies` (key: part), and
    each noised tensor's null residuals to `nulls` (key: part, then the tensor's index). `reference`:
    (chunk sums, their magnitudes) of a one-part release whose step's total noise is measured."""
    for k, (part, values) in enumerate(zip(parts, noisy)):
        if part.noise_std <= 0:
            continue
        key = name if len(parts) == 1 else f"{name}[{k}]"
        tally = tallies.setdefault(key, PrecisionTally())
        per_tensor = None if nulls is None else nulls.setdefault(key, [])
        for i, (value, released) in enumerate(zip(part.values, values)):
            if released.is_floating_point() and value.shape == released.shape:
                tally.add(value, released, part.noise_std)
                if per_tensor is not None:
                    while len(per_tensor) <= i:
                        per_tensor.append(NullTally(tuple(released.shape)))
                    sums = None if reference is None else (reference[0][i], reference[1][i])
                    if sums is not None and sums[0].shape != released.shape:
                        sums = None
                    per_tensor[i].add(value, released, part.noise_std, *(sums or ()))


def precision_checks(tallies: dict[str, PrecisionTally]) -> list[Check]:
    """One row per released part: at most 1% of its informative residuals on the bf16 or fp16 grid."""
    if not tallies:
        return [Check(PRECISION, "released noise", 0.0, MAX_REPRESENTABLE, True, "no release with noise was observed")]
    checks = []
    for key, t in sorted(tallies.items()):
        direct, scaled = t.shares()
        share = max(direct, scaled)
        enough = t.informative >= MIN_INFORMATIVE or t.scaled >= MIN_SCALED
        counts = (f"{t.bf16} of {t.informative} informative residuals (release - value in {', '.join(sorted(t.dtypes))}) "
                  f"are exact in bf16, {t.fp16} in fp16; of {t.scaled} residual / stated std (4 |value| <= |residual|), "
                  f"{t.scaled_bf16} are within {GRID_TOLERANCE:.2g} of bf16's grid, {t.scaled_fp16} of fp16's")
        detail = (f"{counts}: {share:.2%} against at most {MAX_REPRESENTABLE:.0%} (fp32 noise: about 0.05% and 0.2%); noise "
                  "rounded to a narrow format before it is added, or a narrow standard normal scaled by the std, lies on "
                  "its grid" if enough else
                  f"{counts}: fewer than {MIN_INFORMATIVE} (and {MIN_SCALED}), too few to judge (raise audit.noise_steps)")
        if enough and t.informative < MIN_INFORMATIVE:
            detail += f" (fewer than {MIN_INFORMATIVE} informative residuals: the residuals themselves not judged)"
        elif enough and t.scaled < MIN_SCALED:
            detail += f" (fewer than {MIN_SCALED} residual / std: the scaled grids not judged)"
        checks.append(Check(PRECISION, key, share, MAX_REPRESENTABLE, not enough or share <= MAX_REPRESENTABLE, detail))
    return checks


def null_checks(nulls: dict[str, list[NullTally]]) -> list[Check]:
    """One deterministic row per release part: every noised tensor has no residual without noise
    (exactly 0 or not finite) beyond what fp32 rounding explains (`NullTally.allowed`)."""
    if not nulls:
        return [Check(NULL, "released noise", 0.0, 0.0, True, "no release with noise was observed")]
    checks = []
    for key, tensors in sorted(nulls.items()):
        failed = [(i, t) for i, t in enumerate(tensors) if not t.passed]
        said = [f"tensor {i} {list(t.shape)}: {t.null} of {t.draws} residuals exactly 0 (rounding explains at most "
                f"{t.allowed()}), {t.nonfinite} not finite" for i, t in failed[:3]]
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        draws = sum(t.draws for t in tensors)
        detail = ("; ".join(said) + more + ": a tensor whose noise was skipped is released exactly" if failed else
                  f"each of the {len(tensors)} noised tensors ({draws} residuals) carries noise at every coordinate: "
                  f"{sum(t.null for t in tensors)} residuals exactly 0, within what fp32 rounding explains; none not finite")
        checks.append(Check(NULL, key, float(len(failed)), 0.0, not failed, detail))
    return checks


def merged(recorders) -> dict[str, PrecisionTally]:
    """The recorders' tallies added up per release part."""
    out: dict[str, PrecisionTally] = {}
    for recorder in recorders:
        for key, t in recorder.precision.items():
            into = out.setdefault(key, PrecisionTally())
            for name in ("informative", "bf16", "fp16", "scaled", "scaled_bf16", "scaled_fp16"):
                setattr(into, name, getattr(into, name) + getattr(t, name))
            into.dtypes = into.dtypes | t.dtypes
    return out


def merged_nulls(recorders) -> dict[str, list[NullTally]]:
    """The recorders' per-tensor null tallies added up per release part and tensor."""
    out: dict[str, list[NullTally]] = {}
    for recorder in recorders:
        for key, tensors in recorder.nulls.items():
            into = out.setdefault(key, [])
            for i, t in enumerate(tensors):
                while len(into) <= i:
                    into.append(NullTally(t.shape))
                for name in ("draws", "null", "nonfinite", "expected"):
                    setattr(into[i], name, getattr(into[i], name) + getattr(t, name))
    return out

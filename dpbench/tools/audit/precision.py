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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.tools.audit.report import PRECISION, Check

MAX_REPRESENTABLE = 0.01  # fail above 1% representable residuals; fp32 noise gives about 0.05%
MIN_INFORMATIVE = 200  # fewer informative residuals: too few to judge (the row says so and passes)


@dataclass
class PrecisionTally:
    """Per release part: informative residuals, and how many of them are on the bf16 / fp16 grid."""

    informative: int = 0
    bf16: int = 0
    fp16: int = 0
    dtypes: frozenset = frozenset()

    def add(self, value: torch.Tensor, noisy: torch.Tensor) -> None:
        noisy = noisy.detach()
        value = value.detach().to(noisy.dtype)
        residual = (noisy - value).flatten()  # in the release's dtype, as a reader of the release computes it
        value = value.flatten()
        keep = (residual != 0) & ((value == 0) | ((value.abs() >= residual.abs()) & (value.abs() <= 2 * residual.abs())))
        residual = residual[keep].float()
        self.informative += int(residual.numel())
        self.bf16 += int((residual.to(torch.bfloat16).float() == residual).sum())
        self.fp16 += int((residual.to(torch.float16).float() == residual).sum())
        self.dtypes = self.dtypes | {str(noisy.dtype).removeprefix("torch.")}


def tally_release(tallies: dict[str, PrecisionTally], name: str, parts, noisy) -> None:
    """Add one observed release (the observer's parts and noisy values) to `tallies` (key: part)."""
    for k, (part, values) in enumerate(zip(parts, noisy)):
        if part.noise_std <= 0:
            continue
        tally = tallies.setdefault(name if len(parts) == 1 else f"{name}[{k}]", PrecisionTally())
        for value, released in zip(part.values, values):
            if released.is_floating_point() and value.shape == released.shape:
                tally.add(value, released)


def precision_checks(tallies: dict[str, PrecisionTally]) -> list[Check]:
    """One row per released part: at most 1% of its informative residuals on the bf16 or fp16 grid."""
    if not tallies:
        return [Check(PRECISION, "released noise", 0.0, MAX_REPRESENTABLE, True, "no release with noise was observed")]
    checks = []
    for key, t in sorted(tallies.items()):
        share = max(t.bf16, t.fp16) / t.informative if t.informative else 0.0
        enough = t.informative >= MIN_INFORMATIVE
        counts = (f"{t.bf16} of {t.informative} informative residuals (release - value in {', '.join(sorted(t.dtypes))}) "
                  f"are exact in bf16, {t.fp16} in fp16")
        detail = (f"{counts}: {share:.2%} against at most {MAX_REPRESENTABLE:.0%} (fp32 noise: about 0.05%); noise "
                  "rounded to a narrow format before it is added lies on its grid" if enough else
                  f"{counts}: fewer than {MIN_INFORMATIVE}, too few to judge (raise audit.noise_steps)")
        checks.append(Check(PRECISION, key, share, MAX_REPRESENTABLE, not enough or share <= MAX_REPRESENTABLE, detail))
    return checks


def merged(recorders) -> dict[str, PrecisionTally]:
    """The recorders' tallies added up per release part."""
    out: dict[str, PrecisionTally] = {}
    for recorder in recorders:
        for key, t in recorder.precision.items():
            into = out.setdefault(key, PrecisionTally())
            into.informative, into.bf16, into.fp16 = into.informative + t.informative, into.bf16 + t.bf16, into.fp16 + t.fp16
            into.dtypes = into.dtypes | t.dtypes
    return out

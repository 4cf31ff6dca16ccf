"""dpbench-audit's new rows, in isolation: the noise-precision tally, the release's fp32 assert, and
which algorithms get the two-step row (what the class declares)."""

from __future__ import annotations

import math

import pytest
import torch

from dpbench.algorithms import ALGORITHMS, import_all
from dpbench.privacy.release import ReleasePart, gaussian_release
from dpbench.tools.audit.precision import MAX_REPRESENTABLE, NullTally, PrecisionTally, null_checks, precision_checks


def _tally(noise: torch.Tensor, values: torch.Tensor) -> PrecisionTally:
    tally = PrecisionTally()
    tally.add(values, values + noise)
    return tally


# 20,000 residuals, of which 3% to 100% are informative (value 0, or |r| <= |value| <= 2 |r|): at least 600.
# fp32 noise: each is exact in fp16 with probability <= 2^-11, so 0.2% or more of 600 (2+ of mean 0.3) has
# probability below 0.04 and the 1/5 of the limit asserted here below 1e-3; bf16-rounded noise: 75-100% of
# them are exact (it would need all but a handful of 600 to be misses). Failure rate below 1 in 1,000.
@pytest.mark.parametrize("scale", [0.0, 1.0, 10.0])
def test_fp32_noise_passes_and_bf16_rounded_noise_fails(scale):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(20_000, generator=generator) * scale
    noise = torch.randn(20_000, generator=generator)
    (clean,) = precision_checks({"gradient": _tally(noise, values)})
    (rounded,) = precision_checks({"gradient": _tally(noise.to(torch.bfloat16).float(), values)})
    assert clean.passed and clean.measured < MAX_REPRESENTABLE / 5, clean
    assert not rounded.passed and rounded.measured > 0.5, rounded


def test_too_few_informative_residuals_pass_and_say_so():
    (row,) = precision_checks({"x": _tally(torch.ones(10).to(torch.bfloat16).float(), torch.zeros(10))})
    assert row.passed and "too few" in row.detail


class _NarrowNoise:
    def sample(self, shape, std, dtype=torch.float32):
        return torch.zeros(shape, dtype=torch.bfloat16)


def test_the_release_refuses_noise_narrower_than_fp32():
    with pytest.raises(RuntimeError, match="fp32 or wider"):
        gaussian_release("x", [ReleasePart([torch.zeros(3)], 1.0, 1.0)], noise=_NarrowNoise(), sample_rate=1.0,
                         neighboring="add_remove")


def test_the_two_step_row_is_asked_of_the_class():
    import_all()
    carries = sorted(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).release_carries_state)
    assert {"dcdpsgd", "dpdr", "diff", "diff2"} <= set(carries)
    assert not ALGORITHMS.get("dpsgd").release_carries_state


def _tensors_in(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(_tensors_in(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_tensors_in(v) for v in value)
    return False


def _attribute(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
    return obj


import_all()


@pytest.mark.slow  # builds and steps every private algorithm (5-20 s each on two shared cores)
@pytest.mark.parametrize("name", [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).private])
def test_an_algorithm_that_keeps_tensors_across_steps_declares_release_carries_state(name):
    """After two steps, the state a class keeps across steps (its checkpointed attributes, which the
    checkpoint tests prove complete: a resumed run continues exactly) that holds tensors, beyond the
    optimizer's state, the engine's meters and un-noised statistics kept for reporting, makes it
    declare `release_carries_state`, so that dpbench-audit's two-step row runs for it."""
    from helpers.config import FIXED_SIGMA, TINY, compose

    from dpbench.run import setup

    job = setup(compose(TINY + FIXED_SIGMA + [f"algo={name}", "device=cpu"]))
    batch = lambda i: [job.task.batch(list(range(8 * i, 8 * i + 16)))]  # noqa: E731
    for i in range(2):
        job.algorithm.train_step(batch(i), i)
    algorithm = job.algorithm
    kept = [a for a in algorithm.checkpointed_attributes()
            if not a.startswith(("optimizer.", "engine.")) and a not in algorithm.private_statistics()
            and _tensors_in(_attribute(algorithm, a))]
    assert type(algorithm).release_carries_state == bool(kept), (name, kept)


def test_gaussian_noise_refuses_a_standard_normal_narrower_than_fp32(monkeypatch):
    """The standard normal itself is drawn in fp32 or wider: a narrow draw (torch's, or the CSPRNG's)
    is refused at the draw, before any scaling hides it."""
    from dpbench.privacy import noise as module
    from dpbench.privacy.noise import GaussianNoise

    assert GaussianNoise().sample((4,), 1.0).dtype == torch.float32 and GaussianNoise(secure=True).sample((4,), 1.0).dtype == torch.float32
    narrow = GaussianNoise()
    narrow.draw_dtype = torch.bfloat16
    with pytest.raises(RuntimeError, match="fp32 or wider"):
        narrow.sample((4,), 3.4218)
    real = module.secure_standard_normal
    monkeypatch.setattr(module, "secure_standard_normal", lambda count: real(count).astype("float16"))
    with pytest.raises(RuntimeError, match="fp32 or wider"):
        GaussianNoise(secure=True).sample((4,), 3.4218)


# 20,000 residuals of which >= 10,000 have 4 |value| <= |residual| (half the values 0): an fp32 draw lands near
# fp16's grid with probability about 0.14% (measured, 10^6 draws), so more than 0.5% of >= 10,000 (mean ~17,
# above 60) has probability far below 1e-9; a narrow standard normal scaled by sigma is on its grid up to fp32
# rounding (all of them).
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_narrow_standard_normal_scaled_by_sigma_fails_on_residual_over_std(narrow):
    generator, std = torch.Generator().manual_seed(0), 3.4218
    values = torch.rand(20_000, generator=generator) * std * torch.tensor([0.0, 1.0]).repeat(10_000)
    normal = torch.randn(20_000, generator=generator)
    clean, scaled = PrecisionTally(), PrecisionTally()
    clean.add(values, values + normal * std, std)
    scaled.add(values, values + normal.to(narrow).float() * std, std)
    ((clean_row,), (scaled_row,)) = precision_checks({"g": clean}), precision_checks({"g": scaled})
    assert clean_row.passed and clean.shares()[1] < MAX_REPRESENTABLE / 2, clean_row
    assert clean.shares()[0] < MAX_REPRESENTABLE / 5  # sigma 3.4218: the residuals themselves are off the grids
    assert not scaled_row.passed and scaled.shares()[1] > 0.99, scaled_row


def test_a_tensor_released_without_noise_fails_its_null_row_and_fp32_noise_passes():
    """Deterministic: a tensor whose residuals are exactly 0 fails; fp32 noise passes (a rounding zero
    needs |noise| below half a value's spacing, here below 2^-24 of the std: never in 1,000)."""
    generator = torch.Generator().manual_seed(2)
    value, noise = torch.randn(1_000, generator=generator), torch.randn(1_000, generator=generator)
    noised, skipped, small, broken = (NullTally((1_000,)), NullTally((1_000,)), NullTally((4,)), NullTally((4,)))
    noised.add(value, value + noise, 1.0)
    skipped.add(value, value.clone(), 1.0)
    small.add(value[:4], value[:4].clone(), 1.0)
    broken.add(value[:4], value[:4] + torch.tensor([0.5, math.nan, 0.2, 0.1]), 1.0)
    assert noised.passed and noised.null == 0
    assert not skipped.passed and skipped.null == 1_000 and skipped.allowed() <= 4  # rounding 2, a sampler pair 2
    assert not small.passed and small.null == 4
    assert not broken.passed and broken.nonfinite == 1
    (row,) = null_checks({"gradient": [noised, small]})
    assert not row.passed and "tensor 1 [4]: 4 of 4 residuals exactly 0" in row.detail


def test_noise_added_per_chunk_passes_the_null_row_but_skipped_noise_does_not():
    """A release that adds nothing after its chunks added the noise (the sound chunk variant): its own
    residual is 0, the total noise against the engine's chunk sums is not; a small tensor whose chunks
    added none differs from their sums by fp32 rounding only, and fails."""
    generator = torch.Generator().manual_seed(3)
    chunks = [torch.randn(8, generator=generator) for _ in range(4)]
    reference = sum(c.double() for c in chunks)
    magnitude = sum(c.double().abs() for c in chunks)
    summed = chunks[0].clone()
    for c in chunks[1:]:
        summed.add_(c)  # fp32, as the algorithm adds them
    noised = summed + torch.randn(8, generator=generator)  # noise added per chunk (all at once here)
    upstream, skipped = NullTally((8,)), NullTally((8,))
    upstream.add(noised, noised.clone(), 1.0, reference, magnitude)  # the release adds nothing
    skipped.add(summed, summed.clone(), 1.0, reference, magnitude)
    assert upstream.passed and upstream.null == 0
    assert not skipped.passed and skipped.null == 8


def test_the_null_allowance_is_a_chernoff_bound():
    tally = NullTally((1,))
    assert tally.allowed() == 0
    tally.expected = 1e-6
    assert tally.allowed() == 1  # P(Z >= 2) <= (e E / 2)^2 ~ 2e-12
    tally.expected = 5.0
    assert 15 <= tally.allowed() <= 30


def test_the_samplers_exact_zero_pairs_are_allowed_in_large_tensors_only():
    """torch's fp32 normal_ returns an exact 0, for both normals of a Box-Muller pair, where its 24-bit
    uniform is 0 (9 zeros in 1e8 draws measured): a sharded audit once saw 2 of 73,728 residuals exactly
    0 in one [192, 64] tensor, a false alarm. One such pair is allowed there; a small tensor whose
    noise was skipped (24 of 24 zero, or all of a 4-entry one) still fails."""
    seen = NullTally((192, 64))
    seen.draws, seen.null = 73_728, 2
    assert seen.passed and seen.allowed() == 4
    for size in (4, 24):
        skipped = NullTally((size,))
        skipped.draws = skipped.null = size
        assert not skipped.passed and skipped.allowed() < size
    assert NullTally((4,), draws=4).allowed() == 0

"""dpbench-audit's new rows, in isolation: the noise-precision tally, the release's fp32 assert, and
which algorithms get the two-step row (what the class declares)."""

from __future__ import annotations

import pytest
import torch

from dpbench.algorithms import ALGORITHMS, import_all
from dpbench.privacy.release import ReleasePart, gaussian_release
from dpbench.tools.audit.precision import MAX_REPRESENTABLE, PrecisionTally, precision_checks


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
    assert {"dcdpsgd", "dpdr"} <= set(carries)
    assert not ALGORITHMS.get("dpsgd").release_carries_state


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

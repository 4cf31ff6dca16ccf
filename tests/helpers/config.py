"""The one way tests compose a config: exactly as `dpbench <overrides>` does."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A run of a few steps on the synthetic dataset, without W&B.
TINY = ["dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3", "train.eval_every=2"]
# No W&B, and the CPU even where CUDA exists (tests that build tasks and models themselves).
OFFLINE = ["logger=none", "device=cpu"]
# A fixed noise multiplier instead of one calibrated to privacy.epsilon: the calibration's bisection
# over the RDP accountant is most of a tiny run's time. For tests that do not check calibration.
FIXED_SIGMA = ["privacy.noise_multiplier=1.0"]


def compose(overrides: list[str] | None = None):
    """The config `dpbench <overrides>` would run (without Hydra's runtime section)."""
    from dpbench.api import compose as api_compose

    return api_compose(overrides)

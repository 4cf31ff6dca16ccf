"""The one way tests compose a config: exactly as `dpbench <overrides>` does."""

from __future__ import annotations

import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A run of a few steps on the synthetic dataset, without W&B.
TINY = ["dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3", "train.eval_every=2"]
# No W&B, and the CPU even where CUDA exists (tests that build tasks and models themselves).
OFFLINE = ["logger=none", "device=cpu"]
# A fixed noise multiplier instead of one calibrated to privacy.epsilon: the calibration's bisection
# over the RDP accountant is most of a tiny run's time. For tests that do not check calibration.
FIXED_SIGMA = ["privacy.noise_multiplier=1.0", "privacy.epsilon=null"]  # sigma fixed, epsilon computed (a preset's epsilon cleared)


def compose(overrides: list[str] | None = None):
    """The config `dpbench <overrides>` would run (without Hydra's runtime section)."""
    from dpbench.api import compose as api_compose

    return api_compose(overrides)


@functools.cache
def config_groups() -> frozenset[str]:
    """The config groups (experiment, algo, model, dataset, ...): the directories of conf/."""
    from dpbench.paths import config_dir

    return frozenset(p.name for p in Path(config_dir()).iterdir() if p.is_dir())


def compose_point(point: list[str], bases: dict):
    """A grid point's config as `dpbench -m` composes it, in a fraction of the time: its
    config-group choices are composed once (cached in `bases`), the other keys are set on a copy
    as their overrides would set them (Hydra's own parser reads each value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    groups = tuple(o for o in point if o.split("=")[0].lstrip("+") in config_groups())
    if groups not in bases:
        bases[groups] = compose(list(groups))
    cfg = bases[groups].copy()
    with open_dict(cfg):
        for override in OverridesParser.create().parse_overrides([o for o in point if o not in groups]):
            OmegaConf.update(cfg, override.key_or_group, override.value(), force_add=True)
    return cfg

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parents[1]


def compose(overrides: list[str] | None = None):
    """The config `dpbench <overrides>` would run (without Hydra's runtime section)."""
    from dpbench.api import compose as api_compose

    return api_compose(overrides)


TINY = ["dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3", "train.eval_every=2"]


@pytest.fixture
def tiny_cfg():
    return lambda *extra: compose(TINY + list(extra))

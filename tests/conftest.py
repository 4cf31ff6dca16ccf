import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parents[1]


def compose(overrides: list[str] | None = None):
    """The config `dpbench <overrides>` would run (without Hydra's runtime section)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dpbench.paths import config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


TINY = ["dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3", "train.eval_every=2"]


@pytest.fixture
def tiny_cfg():
    return lambda *extra: compose(TINY + list(extra))

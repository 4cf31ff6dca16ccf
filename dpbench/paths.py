"""Where the Hydra configs are: inside the installed wheel, or conf/ of a source checkout."""

from __future__ import annotations

from pathlib import Path


def config_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"dpbench's conf/ directory was not found next to {here}; reinstall dpbench")

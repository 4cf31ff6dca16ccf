"""Provenance of a run: package versions, the device, the source commit and the command line."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

import dpbench

PROVENANCE_PACKAGES = ["torch", "opacus", "timm", "transformers", "peft", "hydra-core", "wandb", "dp-accounting", "numpy"]


def git_commit() -> str | None:
    """The commit of the source checkout dpbench runs from (None for an installed wheel)."""
    root = Path(dpbench.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None


def versions(device: torch.device) -> dict:
    """What results.json records of the software and hardware a run used."""

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "dpbench": dpbench.__version__,
        **{name.replace("-", "_"): installed(name) for name in PROVENANCE_PACKAGES},
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "git_commit": git_commit(),
        "command": " ".join(sys.argv),
    }

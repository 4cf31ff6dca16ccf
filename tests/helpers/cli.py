"""The console script as a user runs it, in a fresh process (tests using it are marked slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.config import REPO


def dpbench(*args: str, cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`dpbench <args>` in cwd, with HOME=cwd (W&B and the Hugging Face caches stay inside the
    test's folder), W&B off and one torch thread (pytest-xdist runs two tests at once on two
    cores); `env` adds or replaces variables."""
    environment = {"WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", ""),
                   "HOME": str(cwd), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "dpbench.cli", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)

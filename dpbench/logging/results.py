"""results.json: the source of truth that reports, resumption and checks read."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

RESULTS_FILE = "results.json"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null means "not measured"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_results(run_dir: Path, results: dict) -> Path:
    """Write atomically: a reader sees the old file or the complete new one, never half of it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESULTS_FILE
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".results-", suffix=".json")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; colleagues and Docker volume owners must read it
    with os.fdopen(fd, "w") as handle:
        json.dump(_jsonable(results), handle, indent=2, sort_keys=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_results(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())

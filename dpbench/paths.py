"""Files: where the Hydra configs are (inside the installed wheel, or conf/ of a source checkout),
and atomic writes of the files a run leaves (results.json, checkpoints)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def config_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"dpbench's conf/ directory was not found next to {here}; reinstall dpbench")


def atomic_write(path: Path, write: Callable[[IO], None], binary: bool = False) -> Path:
    """Write `path` through `write(handle)` atomically (temp file, fsync, os.replace): a reader
    sees the old file or the complete new one, never half of it. The file gets the usual
    0666 & ~umask mode (mkstemp makes 0600; colleagues and Docker volume owners must read it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb" if binary else "w") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


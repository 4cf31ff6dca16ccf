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


# Config keys that change neither what a run computes nor where it lives: a stored run that
# differs only in these is reused on resume, and a grid's job folder names leave them out
# (conf/config.yaml's override_dirname.exclude_keys reads them through `excluded_from_dirname`).
RUN_INVARIANT_KEYS = ("logger", "resume", "name", "audit", "threads", "optimize", "train.checkpoint_every")


def excluded_from_dirname() -> list[str]:
    """RUN_INVARIANT_KEYS as Hydra's override_dirname matches them: whole keys, so a section's
    own keys (`logger.mode=online`, `audit.trials=3`) are listed one by one."""
    import dataclasses

    from dpbench.schema import AuditOptions, WandbOptions

    sections = {"logger": WandbOptions, "audit": AuditOptions}
    keys = []
    for key in RUN_INVARIANT_KEYS:
        keys.append(key)
        if key in sections:
            keys += [f"{key}.{field.name}" for field in dataclasses.fields(sections[key])]
    return keys

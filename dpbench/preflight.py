"""What the machine must offer before a run starts, checked before any work and before the run's
folder is made: the device, a W&B login for online logging, a writable output folder. Each is
checked offline (nothing is contacted) and refused in one line naming the fix.

The console script checks them in a Hydra callback before Hydra makes the run folder
(`dpbench.cli.Preflight`); `dpbench.api.run` before it runs the job."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from dpbench.errors import UserError

WANDB_DEFAULT_HOST = "https://api.wandb.ai"  # W&B's own default (WANDB_BASE_URL overrides it)


class Refused(BaseException):
    """A UserError raised from a Hydra callback: Hydra turns a callback's Exception into a warning
    and goes on, so the refusal travels as a BaseException to the console script (dpbench.cli.main)."""

    def __init__(self, error: UserError) -> None:
        super().__init__(str(error))
        self.error = error


def check_device(cfg: DictConfig) -> None:
    """device=cuda on a machine without CUDA: one line, before anything touches the device."""
    import torch

    if str(cfg.get("device")) == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible to torch; use device=cpu or device=auto")


def check_threads(cfg: DictConfig) -> None:
    """threads=N: torch.set_num_threads takes a positive count (the job sets it before its other checks)."""
    threads = cfg.get("threads")
    if threads is not None and threads < 1:
        raise UserError(f"threads must be a positive integer or null (torch's default), got {threads}")


def wandb_login_found() -> bool:
    """Whether W&B would find an API key, read as W&B reads it (the WANDB_API_KEY variable, else the
    netrc entry for its host), without contacting the server."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST).hostname or ""
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no netrc, unreadable or malformed: no login W&B could use
        return False
    return bool(entry and entry[2])


def check_wandb_login(cfg: DictConfig) -> None:
    """logger.mode=online (or WANDB_MODE=online) without a W&B login: one line, not W&B's prompt or traceback."""
    logger = cfg.get("logger") or {}
    if str(logger.get("name")) != "wandb":
        return
    mode = os.environ.get("WANDB_MODE") or str(logger.get("mode"))  # as dpbench.logging.wandb_logger chooses it
    if mode == "online" and not wandb_login_found():
        asked = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "logger.mode=online"
        raise UserError(f"{asked} but no W&B login is found (no WANDB_API_KEY, no netrc entry for "
                        f"{urlparse(os.environ.get('WANDB_BASE_URL') or WANDB_DEFAULT_HOST).hostname}): run `wandb login` "
                        "first, or log offline (logger.mode=offline, then `wandb sync`) or not at all (logger=none)")


def check_writable(folder: str | Path, key: str) -> None:
    """The folder a run writes can be made: its nearest existing parent is a writable folder.
    `key` names the setting that chose it (hydra.run.dir, hydra.sweep.dir, run_dir)."""
    folder = Path(folder).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"cannot make the run folder {folder}: {existing} is a file, not a folder; set {key}=<a folder>")
    if not (os.access(existing, os.W_OK | os.X_OK) and _can_make_folder_in(existing)):
        raise UserError(f"cannot write the run folder {folder}: {existing} is not writable; "
                        f"set {key}=<a writable folder>, or run from a writable directory")


def _can_make_folder_in(parent: Path) -> bool:
    """Make and remove an empty folder in `parent`: permission bits say nothing for root, a
    read-only mount or a file system that refuses folders (os.access alone would pass them)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dpbench-write-check-", dir=parent))
    except OSError:
        return False
    return True


def check_environment(cfg: DictConfig, folder: str | Path, key: str) -> None:
    """Every check of this module, cheapest first."""
    check_writable(folder, key)
    check_threads(cfg)
    check_device(cfg)
    check_wandb_login(cfg)

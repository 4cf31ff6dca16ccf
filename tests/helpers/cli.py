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


def torchrun(*args: str, cwd: Path, module: str = "dpbench.cli", world: int = 2,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=<world> -m <module> <args>` in cwd on a free port, one torch
    thread per rank, W&B off (world 1: `python -m <module>`, one process without torchrun)."""
    from helpers.ranks import free_port

    launch = [] if world == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={world}",
                                    "--master_port", str(free_port())]
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *launch, "-m", module, *args], check=False, cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def dpbench_in_process(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`dpbench <args>` as `dpbench()` runs it, but through `dpbench.cli.main` in this process:
    the same composition, job and exit status without a new interpreter's imports (seconds per
    call). For tests of what the command does; a test of the process itself (signals, torchrun,
    W&B's service, the installed script) uses `dpbench()`."""
    from dpbench import cli

    cli._own_exit.clear()
    cli._grid_failures.clear()
    return console_script_in_process(cli.main, "dpbench", *args, cwd=cwd, **env)


def console_script_in_process(main, prog: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A console script's `main` with argv `prog args`, run here with cwd and env set as
    `dpbench()` sets them and restored afterwards; stdout and stderr captured. A traceback that
    would end the process is its stderr with status 1, as Python's would be."""
    import contextlib
    import io
    import logging
    import traceback

    from hydra.core.global_hydra import GlobalHydra

    environment = {"WANDB_MODE": "disabled", "HOME": str(cwd), **env}
    saved_env = {key: os.environ.get(key) for key in environment}
    # Hydra sets up job logging with logging.config.dictConfig, which closes every handler the
    # process ever made (logging._handlerList), e.g. absl's, bound to the stream pytest captures
    # into: a fresh process has none, so they are hidden from the call and put back after it.
    host_handlers = logging._handlerList[:]
    logging._handlerList[:] = []
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    try:
        os.environ.update(environment)
        os.chdir(cwd)
        sys.argv = [prog, *args]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main()
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except Exception:  # noqa: BLE001 - what the interpreter would print before exiting 1
                traceback.print_exc()
                status = 1
    finally:
        logging._handlerList[:0] = host_handlers
        GlobalHydra.instance().clear()
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess([prog, *args], status, stdout.getvalue(), stderr.getvalue())


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this user cannot write: permission bits, or (root ignores them) one in /proc, where
    no folder can be made."""
    if os.geteuid() == 0:
        return Path("/proc/dpbench-test/run")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder / "run"

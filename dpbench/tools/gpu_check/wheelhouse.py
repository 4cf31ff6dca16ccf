"""The offline install: a wheelhouse made where the package registry is reachable, installed on a
GPU node that has none (docs/gpu-check.md).

Standard library only: on the node this module runs from the dpbench wheel itself (on
PYTHONPATH, before any dependency is installed).

The wheelhouse holds dpbench's wheel and its runtime dependencies at the versions constraints.txt
pins, minus the CUDA stack (torch, torchvision, triton, nvidia-*): the node keeps its own CUDA
build of torch, and a registry torchvision would pin another torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

NODE_CONSTRAINTS = "node-constraints.txt"  # the pins the node installs with (written into the wheelhouse)
LAUNCHER = "gpu-check.sh"  # the node's one command (written into the wheelhouse)
# The node's own CUDA build provides these: never downloaded, never replaced.
CUDA_STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")


class WheelhouseError(Exception):
    """Bad input or a missing prerequisite: one line, exit status 2."""


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def from_cuda_stack(name: str) -> bool:
    return bool(CUDA_STACK.match(normalize(name)))


def source_root() -> Path:
    """The source checkout this module belongs to (the wheel is built from it)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").is_file() or not (root / "constraints.txt").is_file():
        raise WheelhouseError("the wheelhouse is built from a source checkout of dpbench (pyproject.toml and "
                              "constraints.txt beside dpbench/); run this command from one")
    return root


def wheel_command(root: Path, folder: Path) -> list[str]:
    """dpbench's own wheel, built from the checkout."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(folder), str(root)]


def resolve_command(wheel: Path, constraints: Path, report: Path) -> list[str]:
    """The full dependency closure at the pinned versions, resolved without installing anything
    (pip reads the wheels' metadata only): its report names every distribution."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "-c", str(constraints), str(wheel)]


def closure_pins(report: dict, skip: str = "dpbench") -> list[str]:
    """name==version of every distribution in pip's install report, except the CUDA stack and dpbench."""
    pins = []
    for item in report.get("install", []):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if normalize(name) != normalize(skip) and not from_cuda_stack(name):
            pins.append(f"{name}=={version}")
    return sorted(pins, key=str.lower)


def download_command(pins: list[str], folder: Path) -> list[str]:
    """Wheels of exactly these pins (`pip wheel`: pip download's wheels, and a wheel built where a
    project ships only a source archive, so the node never builds anything)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(folder), *pins]


LAUNCHER_TEXT = """#!/bin/sh
# dpbench's offline GPU check (docs/gpu-check.md): install from this folder, keep the node's torch, run.
here=$(cd "$(dirname "$0")" && pwd)
wheel=$(ls "$here"/dpbench-*.whl | head -n 1)
PYTHONPATH="$wheel" exec "${PYTHON:-python}" -m dpbench.tools.gpu_check node "$here" "$@"
"""


def build(folder: Path, run=subprocess.run) -> list[str]:
    """Fill `folder`: dpbench's wheel, its pinned dependencies' wheels, the node's constraints and
    the launcher. Returns the pins. `run` is subprocess.run's seam for tests."""
    root = source_root()
    folder.mkdir(parents=True, exist_ok=True)
    run(wheel_command(root, folder), check=True)
    wheels = sorted(folder.glob("dpbench-*.whl"))
    if not wheels:
        raise WheelhouseError(f"pip built no dpbench wheel into {folder}")
    report_path = folder / "resolve-report.json"
    run(resolve_command(wheels[-1], root / "constraints.txt", report_path), check=True)
    pins = closure_pins(json.loads(report_path.read_text()))
    report_path.unlink()
    run(download_command(pins, folder), check=True)
    (folder / NODE_CONSTRAINTS).write_text("# dpbench's runtime closure as pinned by constraints.txt, without the CUDA stack\n"
                                           + "\n".join(pins) + "\n")
    launcher = folder / LAUNCHER
    launcher.write_text(LAUNCHER_TEXT)
    launcher.chmod(0o755)
    return pins


def check_wheelhouse(folder: Path, requirement: str = "dpbench") -> None:
    """The folder exists and holds the requirement's wheel and the node's constraints."""
    if not folder.is_dir():
        raise WheelhouseError(f"wheelhouse {folder} does not exist; make it where the registry is reachable "
                              f"(python -m dpbench.tools.gpu_check wheelhouse {folder}) and copy it to this node")
    if not list(folder.glob(f"{normalize(requirement).replace('-', '_')}-*.whl")) or not (folder / NODE_CONSTRAINTS).is_file():
        raise WheelhouseError(f"{folder} holds no {requirement} wheel or no {NODE_CONSTRAINTS}; "
                              f"make it with: python -m dpbench.tools.gpu_check wheelhouse {folder}")


def kept_pins(distributions=("torch", "torchvision"), version=importlib.metadata.version) -> list[str]:
    """The node's installed CUDA stack, pinned as it is: pip may then never replace it."""
    pins = []
    for name in distributions:
        try:
            pins.append(f"{name}=={version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise WheelhouseError(f"{name} is not installed on this node; install its CUDA build first "
                                  f"(the wheelhouse leaves the CUDA stack to the node)") from None
    return pins


def install_command(folder: Path, keep: Path, requirement: str = "dpbench", extra: tuple[str, ...] = ()) -> list[str]:
    """pip from the wheelhouse alone: no index, the wheelhouse's pins and the node's kept stack."""
    return [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder),
            "-c", str(folder / NODE_CONSTRAINTS), "-c", str(keep), *extra, requirement]


def install(folder: Path, requirement: str = "dpbench", keep_distributions=("torch", "torchvision"),
            extra: tuple[str, ...] = (), run=subprocess.run) -> list[str]:
    """Install `requirement` and its dependencies from the wheelhouse; returns the command run."""
    import tempfile

    check_wheelhouse(folder, requirement)
    pins = kept_pins(keep_distributions)
    with tempfile.TemporaryDirectory(prefix="dpbench_keep_") as scratch:
        keep = Path(scratch) / "kept.txt"
        keep.write_text("\n".join(pins) + "\n")
        command = install_command(folder, keep, requirement, extra)
        done = run(command)
        if done.returncode != 0:
            raise WheelhouseError(f"pip could not install {requirement} from {folder} (exit {done.returncode}); "
                                  "see pip's message above")
    return command

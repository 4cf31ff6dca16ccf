"""The documentation site (docs/, mkdocs.yml) builds with `mkdocs build --strict`, every page is in
the nav, and the README stays a front page whose links into docs/ resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers.config import REPO

DOCS = REPO / "docs"
README_MAX_LINES = 250


def nav_pages(nav) -> list[str]:
    """The Markdown files of a mkdocs nav (nested sections included)."""
    pages = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                pages += nav_pages(value)
            elif isinstance(value, str) and value.endswith(".md"):
                pages.append(value)
    return pages


def mkdocs_config() -> dict:
    # mkdocs.yml holds no Python tags, so the safe loader reads it.
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


@pytest.mark.slow  # starts mkdocs in a subprocess
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"), "-d", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file()
    assert (site / "api" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    in_nav = set(nav_pages(mkdocs_config()["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), "pages missing from mkdocs.yml's nav"
    assert in_nav - pages == set(), "nav entries without a page"


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES


def test_readme_links_into_docs_resolve():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)\s#]*)(#[^)\s]*)?\)", text)
    assert links, "the README links to the documentation pages"
    for path, _anchor in links:
        assert (REPO / path).is_file(), f"README links to {path}, which does not exist"
    linked = {path for path, _ in links}
    for page in nav_pages(mkdocs_config()["nav"]):
        assert f"docs/{page}" in linked, f"the README does not link to docs/{page}"


def test_every_repository_path_the_docs_and_code_name_exists():
    """A file named in docs/, the README or a docstring (`tests/...py`, `dpbench/...py`) is where it
    says: the re-cut moved files, and a stale pointer sends a newcomer nowhere."""
    texts = [*DOCS.glob("*.md"), REPO / "README.md", *(REPO / "dpbench").rglob("*.py"), *(REPO / "dpbench").rglob("*.md")]
    missing = set()
    for path in texts:
        for name in re.findall(r"\b((?:tests|dpbench)/[\w/]+\.(?:py|md|pt))\b", path.read_text()):
            if not (REPO / name).exists():
                missing.add(f"{path.relative_to(REPO)}: {name}")
    assert not missing, sorted(missing)

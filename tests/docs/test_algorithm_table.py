"""docs/algorithms.md is generated from the registry (dpbench/tools/algorithm_table.py): the page
agrees with what every registered algorithm declares, and a new algorithm appears on it."""

from __future__ import annotations

from helpers.config import REPO
from helpers.toy_algorithms import partial_toy  # noqa: F401 (a fixture)

from dpbench.tools.algorithm_table import algorithm_page

PAGE = REPO / "docs" / "algorithms.md"


def test_the_algorithm_page_is_the_registrys():
    assert PAGE.read_text() == algorithm_page(), \
        "docs/algorithms.md is stale: python -m dpbench.tools.algorithm_table --write docs/algorithms.md"


def test_a_new_algorithm_gets_its_row_from_its_declarations(partial_toy):
    page = algorithm_page()
    assert "| `partial` | yes | 0.02 (adam) | 1 | any (`algo.per_sample`) | `examples` | – | `algo.full_modules` | yes |" \
        in page  # its options dataclass's defaults (its YAML is outside conf/), its class's declarations
    assert "- `partial`: Partial: DP-SGD on the modules `algo.full_modules` names" in page
    assert "| `dpgd0th` | yes |" in page and page.count("| `dpadam` |") == 1

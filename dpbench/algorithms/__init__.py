"""Training algorithms, by name (`algo=...`): one module per algorithm, registered on import.

Every module in this package is imported by `algorithm_class`, so adding an algorithm is adding
one file with a class decorated `@ALGORITHMS.register("name")` and a conf/algo/name.yaml.
"""

from __future__ import annotations

from dpbench.algorithms.base import ALGORITHMS, Algorithm, PrivacySetup, StepResult
from dpbench.registry import import_submodules

__all__ = ["ALGORITHMS", "Algorithm", "PrivacySetup", "StepResult", "algorithm_class", "import_all"]


def import_all() -> None:
    import_submodules(__name__)  # the discovery rule of every registry (dpbench/registry.py)


def algorithm_class(name: str) -> type[Algorithm]:
    import_all()
    return ALGORITHMS.get(name)

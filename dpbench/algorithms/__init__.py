"""Training algorithms, by name (`algo=...`): one module per algorithm, registered on import.

ALGORITHMS imports every module in this package on lookup (dpbench/registry.py), so adding an
algorithm is one file, with a class decorated `@ALGORITHMS.register("name", options=NameOptions)`
and its options dataclass beside it, and a conf/algo/name.yaml.
"""

from __future__ import annotations

from dpbench.algorithms.base import ALGORITHMS, Algorithm, PrivacySetup, StepResult

__all__ = ["ALGORITHMS", "Algorithm", "PrivacySetup", "StepResult", "algorithm_class", "import_all"]


def import_all() -> None:
    ALGORITHMS.names()  # a lookup imports every module of the package (dpbench/registry.py)


def algorithm_class(name: str) -> type[Algorithm]:
    return ALGORITHMS.get(name)

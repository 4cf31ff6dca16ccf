"""Training algorithms, by name (`algo=...`): one module per algorithm, registered on import.

Every module in this package is imported by `algorithm_class`, so adding an algorithm is adding
one file with a class decorated `@ALGORITHMS.register("name")` and a conf/algo/name.yaml.
"""

from __future__ import annotations

import importlib
import pkgutil

from dpbench.algorithms.base import ALGORITHMS, Algorithm, PrivacySetup, StepResult

__all__ = ["ALGORITHMS", "Algorithm", "PrivacySetup", "StepResult", "algorithm_class", "import_all"]


def import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def algorithm_class(name: str) -> type[Algorithm]:
    import_all()
    return ALGORITHMS.get(name)

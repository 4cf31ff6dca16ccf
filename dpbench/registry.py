"""A tiny name -> builder registry (timm's @register_model style).

Adding an algorithm, model, dataset or accountant is one decorated function or class in its own
file; tests are parametrised over the registries, so a new entry is tested automatically.

One discovery rule for every registry: a registry made with `package=` imports every module of
that package on its first lookup, so a new file registers itself with no import list to edit.
Modules in such packages keep heavy optional imports (transformers) inside functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

from dpbench.errors import UserError

T = TypeVar("T")


def import_submodules(package: str) -> None:
    """Import every module of `package` (their decorators register them)."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str | None = None):
        self.kind = kind
        self.package = package  # discovered on first lookup (see the module docstring)
        self._entries: dict[str, T] = {}
        self._discovered = package is None

    def _discover(self) -> None:
        if not self._discovered:
            import_submodules(self.package)
            self._discovered = True  # after: a failed import is raised again on the next lookup

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return decorator

    def get(self, name: str) -> T:
        self._discover()
        if name not in self._entries:
            raise UserError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

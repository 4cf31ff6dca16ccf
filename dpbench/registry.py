"""A tiny name -> builder registry (timm's @register_model style).

Adding an algorithm, model, dataset or accountant is one decorated function or class in its own
file; tests are parametrised over the registries, so a new entry is tested automatically. An entry
may carry its typed options (`@ALGORITHMS.register("grape", options=GrapeOptions)`, the dataclass
beside the class, as timm keeps a model's default_cfg beside its builder): dpbench/schema.py builds
the config schema from them, so the options have no second home.

One discovery rule for every registry: a registry made with `package=` imports the modules of that
package on every lookup. Python imports each module once, so only a module added since (a new
file, a plugin directory appended to the package's `__path__`) costs anything, and a new file
registers itself with no import list to edit. Modules in such packages keep heavy optional
imports (transformers) inside functions.
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
        self.package = package  # its modules are imported on each lookup (see the module docstring)
        self._entries: dict[str, T] = {}
        self._options: dict[str, type] = {}

    def _discover(self) -> None:
        if self.package is not None:
            import_submodules(self.package)  # a failed import is raised again on the next lookup

    def register(self, name: str, options: type | None = None) -> Callable[[T], T]:
        """Decorator: `entry` is `name`; `options`, its typed options (a dataclass), if it has any."""

        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            if options is not None:
                self._options[name] = options
            return entry

        return decorator

    def unregister(self, name: str) -> None:
        """Forget `name` (a test's temporary entry); its module stays imported."""
        self._entries.pop(name, None)
        self._options.pop(name, None)

    def get(self, name: str) -> T:
        self._discover()
        if name not in self._entries:
            raise UserError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def options(self, name: str) -> type | None:
        """The options dataclass `name` was registered with (None: it has none)."""
        self.get(name)
        return self._options.get(name)

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

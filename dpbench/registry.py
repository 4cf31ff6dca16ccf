"""A tiny name -> builder registry (timm's @register_model style).

Adding an algorithm, model, dataset or accountant is one decorated function or class in its own
file; tests are parametrised over the registries, so a new entry is tested automatically.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from dpbench.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return decorator

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise UserError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

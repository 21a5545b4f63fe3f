# Chapter 01 (01_req_batch_context.ipynb): a name -> object registry.
"""A registry maps names ("torch", "LlamaForCausalLM", ...) to the objects that implement them.

Registering a name again replaces the old entry, so re-running a notebook cell is harmless.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Iterable, List, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            self._items[name] = item
            return item

        return decorator

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; supported: "
                           f"{', '.join(self.supported_names())}")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def supported_names(self) -> List[str]:
        return sorted(self._items)

    def assert_supported(self, names: Iterable[str]) -> None:
        for name in names:
            self[name]

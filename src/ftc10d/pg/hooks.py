"""Hook registries with torch 2.14's semantics.

Hooks fire in registration order. A hook that raises is logged under the
``ftc10d`` logger and never breaks the op or the hooks after it: observability
must not become a new way to fail.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ftc10d.types import InvalidOptionError

logger = logging.getLogger("ftc10d")


class HookRegistry:
    """An ordered ``hook_id -> fn`` map. ``fns`` is a tuple, swapped on change,
    so that firing needs no lock and an op in flight sees a consistent set."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._hooks: dict[int, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.fns: tuple[tuple[int, Callable[..., Any]], ...] = ()

    def register(self, hook_id: int, fn: Callable[..., Any]) -> None:
        if isinstance(hook_id, bool) or not isinstance(hook_id, int):
            raise InvalidOptionError(f"{self._kind} hook_id must be an int, got {type(hook_id).__name__}")
        if not callable(fn):
            raise InvalidOptionError(f"{self._kind} hook must be callable, got {type(fn).__name__}")
        with self._lock:
            if hook_id in self._hooks:
                raise InvalidOptionError(
                    f"{self._kind} hook id {hook_id} is already registered; unregister it first or pick another id"
                )
            self._hooks[hook_id] = fn
            self.fns = tuple(self._hooks.items())

    def unregister(self, hook_id: int) -> None:
        with self._lock:
            if hook_id not in self._hooks:
                raise InvalidOptionError(f"no {self._kind} hook registered with id {hook_id}")
            del self._hooks[hook_id]
            self.fns = tuple(self._hooks.items())

    def fire(self, *args: Any) -> None:
        for hook_id, fn in self.fns:
            try:
                fn(*args)
            except Exception:
                logger.exception("%s hook %d raised; ignored", self._kind, hook_id)

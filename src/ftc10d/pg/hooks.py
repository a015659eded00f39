"""Hook registries with torch 2.14's semantics.

Hooks fire in registration order. Registering an id again replaces its hook (in its
place); unregistering an unknown id does nothing. A pre-hook that raises raises to the
caller of the op, and the op is not issued (nothing is sent); a post-hook that raises
raises to the caller after the op was issued (it runs on). An abort hook that raises
is logged under the ``ftc10d`` logger and the abort goes on: an abort must complete.
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
            self._hooks[hook_id] = fn  # an id registered again keeps its place, as in torch
            self.fns = tuple(self._hooks.items())

    def unregister(self, hook_id: int) -> None:
        with self._lock:
            if self._hooks.pop(hook_id, None) is not None:
                self.fns = tuple(self._hooks.items())

    def fire(self, *args: Any) -> None:
        """Call every hook in order; the first that raises stops them and raises."""
        for _, fn in self.fns:
            fn(*args)

    def fire_all(self, *args: Any) -> None:
        """Call every hook in order; one that raises is logged and the others still run."""
        for hook_id, fn in self.fns:
            try:
                fn(*args)
            except Exception:
                logger.exception("%s hook %d raised; ignored", self._kind, hook_id)

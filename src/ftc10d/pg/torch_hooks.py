"""torch's own collective hooks on ftc10d groups: ``NanCheckHook``, ``FlightRecorderHook``,
``TORCH_DIST_NAN_CHECK`` (torch 2.14+).

torch 2.14 ships two debug features built on its pre/post collective hooks. They are C++
objects that register C++ hooks into the group's C++ hook map, and torch fires that map
from its dispatcher kernels (``Ops.cpp``) only. An ftc10d group's ops are Python methods
reached through torch's ``PyProcessGroup`` trampoline; they never pass those kernels, so
the C++ hooks attach and then see nothing: a NaN all-reduce went through silently.

Routing every op through the dispatcher would make them fire, but it needs a second
Python object (a ``Backend`` trampoline) on every op's path and boxed reduce ops that
torch cannot build from Python. Instead, where ``attach`` is given an ftc10d group, the
same check runs as an ftc10d hook with torch's behaviour (measured against torch's
native Gloo group on the same torch, ``tests/pg/test_torch_hooks.py``):

- ``NanCheckHook.attach(pg)``: before each op, the op's *input* floating-point tensors
  are checked for NaN; one found raises ``RuntimeError("NaN found in input tensor.")`` to
  the caller and nothing is sent. As in torch, a broadcast or scatter is checked on its
  root only, receive buffers and outputs never.
- ``TORCH_DIST_NAN_CHECK=1`` attaches it to every ftc10d group at creation, as torch does
  for the groups it creates.
- ``FlightRecorderHook.attach(pg)`` turns ftc10d's flight recorder on for that group (it
  is on by default: then nothing changes) and ``remove()`` turns off what that call turned
  on, nothing more. Its records are read with ftc10d's dump
  (``ftc10d.flight_recorder.dump``, torch's fr_trace format), not with torch's
  ``_dump_fr_trace()``, whose buffer only C++ can write.

Both ``attach`` return a handle with ``remove()`` (not torch's class). Every other group
goes to torch's own ``attach``, unchanged. This is done by wrapping the two classes'
``attach`` when ftc10d is imported; nothing else of torch is touched.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch._C._distributed_c10d as _c10d

from ftc10d.types import HookOpName

if TYPE_CHECKING:
    from ftc10d.pg.process_group import ProcessGroup

logger = logging.getLogger("ftc10d")

#: torch's message, word for word: tools that grep for it find ours too.
NAN_MESSAGE = "NaN found in input tensor."
#: Hook ids ftc10d's own attachments use: negative, where users' ids do not go.
_ids = itertools.count(-0x7FC10D00, -1)
_lock = threading.Lock()
#: class name -> fn(pg) -> handle, for ftc10d groups (FlightRecorderHook is filled in by
#: ftc10d.flight_recorder, which sits above pg/).
ATTACH: dict[str, Callable[["ProcessGroup"], "TorchHookHandle"]] = {}
_installed = False


class TorchHookHandle:
    """What ``NanCheckHook.attach`` / ``FlightRecorderHook.attach`` return for an ftc10d
    group: ``remove()`` detaches it (idempotent, a no-op once the group is gone)."""

    def __init__(self, kind: str, pg: "ProcessGroup", remove: Callable[["ProcessGroup"], None]) -> None:
        self.kind = kind
        self._pg = weakref.ref(pg)
        self._remove: Optional[Callable[["ProcessGroup"], None]] = remove

    def remove(self) -> None:
        fn, self._remove = self._remove, None
        pg = self._pg()
        if fn is not None and pg is not None:
            fn(pg)

    def __repr__(self) -> str:
        return f"<ftc10d {self.kind} on {self._pg()!r}>"


# ------------------------------------------------------------ the NaN check


def _has_nan(tensors: Any) -> bool:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and bool(torch.isnan(t).any()):
            return True
    return False


def _nan_pre_hook(pg: "ProcessGroup") -> Callable[[Any], None]:
    ref = weakref.ref(pg)
    rooted = {HookOpName.BROADCAST, HookOpName.SCATTER}

    def check(args: Any) -> None:
        if args.name in rooted:
            group = ref()
            if group is None or args.root != group.rank():
                return  # torch checks what the root sends, not what the others will receive
        if _has_nan(args.input_tensors):
            raise RuntimeError(NAN_MESSAGE)

    return check


def attach_nan_check(pg: "ProcessGroup") -> TorchHookHandle:
    """Check every op's input tensors of ``pg`` for NaN, as torch's ``NanCheckHook``. Each
    call attaches a check of its own, which its handle's ``remove()`` (only) detaches."""
    hook_id = next(_ids)
    pg.register_pre_hook(hook_id, _nan_pre_hook(pg))
    return TorchHookHandle("NanCheckHook", pg, lambda group: group.unregister_pre_hook(hook_id))


ATTACH["NanCheckHook"] = attach_nan_check


# ------------------------------------------------------------ wrapping torch's attach


def _wrap(cls: Any, name: str) -> None:
    torch_attach = cls.attach

    def attach(pg: Any) -> Any:
        from ftc10d.pg.process_group import ProcessGroup

        ours = ATTACH.get(name)
        if isinstance(pg, ProcessGroup) and ours is not None:
            return ours(pg)
        return torch_attach(pg)

    attach.__doc__ = (f"torch's {name}.attach; on an ftc10d group, ftc10d's equivalent "
                      "(see ftc10d.pg.torch_hooks).")
    attach.__wrapped__ = torch_attach  # type: ignore[attr-defined]
    cls.attach = staticmethod(attach)


def install() -> None:
    """Wrap ``attach`` of torch's hook classes this torch has (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    for name in ("NanCheckHook", "FlightRecorderHook"):
        cls = getattr(_c10d, name, None)
        if cls is not None:
            _wrap(cls, name)


def on_group_created(pg: "ProcessGroup", _flight_recorder: Any) -> None:
    """``TORCH_DIST_NAN_CHECK=1``: every group gets the NaN check, as torch's do (2.14+).
    (A group torch creates gets a second one from torch's own call: the same check twice.)"""
    if os.environ.get("TORCH_DIST_NAN_CHECK", "0") == "1" and getattr(_c10d, "NanCheckHook", None) is not None:
        attach_nan_check(pg)

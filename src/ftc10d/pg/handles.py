"""Reconfigure handles and the validation of ``ReconfigureOptions``.

A handle names one *group object* (one process's ftc10d ``ProcessGroup``) for
its whole life: ``ftc10d/v1/<host>/<pid>/<nonce>``. It carries no address,
because addresses are exchanged through the store at each rendezvous; that is
why a handle never goes stale and peers may cache it. The random nonce makes a
restarted process (same host, same pid after wrap-around) a different member.

Validation happens before anything is aborted or written to the store, so bad
input costs the caller nothing: the group keeps its current configuration.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ftc10d import _compat
from ftc10d.types import (
    DuplicateHandleError,
    InvalidHandleError,
    InvalidOptionError,
    MissingHandleError,
    ReconfigureOptions,
)

HANDLE_PREFIX = "ftc10d/v1/"
_HANDLE_RE = re.compile(r"^ftc10d/v1/(?P<host>[A-Za-z0-9._-]{1,253})/(?P<pid>[0-9]{1,10})/(?P<nonce>[0-9a-f]{16})$")
_HOST_SAFE = re.compile(r"[^A-Za-z0-9._-]")

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: Hints this backend understands. Unknown hints are rejected rather than ignored,
#: so a typo does not silently change behaviour.
SUPPORTED_HINTS: frozenset[str] = frozenset()


def new_handle() -> str:
    host = _HOST_SAFE.sub("-", socket.gethostname())[:253] or "host"
    return f"{HANDLE_PREFIX}{host}/{os.getpid()}/{secrets.token_hex(8)}"


def check_handle(handle: object) -> str:
    if not isinstance(handle, str):
        raise InvalidHandleError(
            f"reconfigure handle must be a str, got {type(handle).__name__} {handle!r}; "
            "pass the strings returned by get_reconfigure_handle()"
        )
    if not _HANDLE_RE.match(handle):
        raise InvalidHandleError(
            f"malformed reconfigure handle {handle!r}: expected 'ftc10d/v1/<host>/<pid>/<16 hex digits>' "
            "as returned by ftc10d get_reconfigure_handle() (handles of other backends are not accepted)"
        )
    return handle


def handle_pid_host(handle: str) -> tuple[str, int]:
    m = _HANDLE_RE.match(handle)
    assert m is not None
    return m.group("host"), int(m.group("pid"))


@dataclass(frozen=True)
class Plan:
    """A validated reconfigure request: who is in, in which order, within what time."""

    uuid: int
    handles: tuple[str, ...]
    rank: int
    timeout: timedelta

    @property
    def size(self) -> int:
        return len(self.handles)


def _get(opts: Any, name: str) -> Any:
    try:
        return getattr(opts, name)
    except AttributeError:
        raise InvalidOptionError(
            f"reconfigure options {type(opts).__name__} has no field {name!r}; "
            "pass ftc10d.ReconfigureOptions(uuid, handles, timeout=None, hints={}) "
            "or torch's ReconfigureOptions"
        ) from None


def check_uuid(uuid: Any) -> int:
    """A configuration uuid as torch 2.14 takes it: an int (not a bool) in int64."""
    if isinstance(uuid, bool) or not isinstance(uuid, int):
        raise InvalidOptionError(f"uuid must be an int (as in torch 2.14), got {type(uuid).__name__} {uuid!r}")
    if not INT64_MIN <= uuid <= INT64_MAX:
        raise InvalidOptionError(f"uuid {uuid} does not fit in a signed 64-bit integer")
    return uuid


def plan_reconfigure(opts: Any, own_handle: str, default_timeout: timedelta) -> Plan:
    """Validate ``opts`` (ftc10d's or torch's ``ReconfigureOptions``) into a :class:`Plan`.

    Raises a typed :class:`~ftc10d.types.ReconfigureError` subclass on any bad input.
    """
    if not isinstance(opts, ReconfigureOptions) and not (
        _compat.TorchReconfigureOptions is not None and isinstance(opts, _compat.TorchReconfigureOptions)
    ):
        raise InvalidOptionError(
            f"reconfigure() takes ReconfigureOptions, got {type(opts).__name__}; "
            "use ftc10d.ReconfigureOptions(uuid, handles) or ftc10d.reconfigure(uuid, handles, group=pg)"
        )
    uuid = check_uuid(_get(opts, "uuid"))

    raw = _get(opts, "handles")
    if isinstance(raw, (set, frozenset)):
        for h in raw:
            check_handle(h)
        ordered = tuple(sorted(raw))
    elif isinstance(raw, (list, tuple)):
        ordered = tuple(check_handle(h) for h in raw)
        seen: set[str] = set()
        for pos, h in enumerate(ordered):
            if h in seen:
                raise DuplicateHandleError(
                    f"handle {h!r} appears more than once in the handle list (again at position {pos}); "
                    "each member must appear exactly once"
                )
            seen.add(h)
    elif isinstance(raw, str):
        raise InvalidHandleError("handles must be a list or set of handle strings, got a single str; wrap it in a list")
    else:
        raise InvalidHandleError(f"handles must be a list (ordered) or a set (sorted), got {type(raw).__name__}")
    if not ordered:
        raise InvalidHandleError("handles is empty: a configuration needs at least this group's own handle")
    try:
        rank = ordered.index(own_handle)
    except ValueError:
        raise MissingHandleError(
            f"this group's handle {own_handle!r} is not among the {len(ordered)} handles given; "
            "a process can only reconfigure into a configuration that includes itself"
        ) from None

    timeout = _get(opts, "timeout")
    if timeout is None:
        timeout = default_timeout
    elif not isinstance(timeout, timedelta):
        raise InvalidOptionError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    elif timeout.total_seconds() <= 0:
        raise InvalidOptionError(f"timeout must be positive, got {timeout}")

    hints = _get(opts, "hints") or {}
    unknown = sorted(set(hints) - SUPPORTED_HINTS)
    if unknown:
        raise InvalidOptionError(
            f"unknown reconfigure hints {unknown}; supported: {sorted(SUPPORTED_HINTS) or 'none'}"
        )
    return Plan(uuid=uuid, handles=ordered, rank=rank, timeout=timeout)


def options(
    uuid: int,
    handles: Any,
    timeout: Optional[timedelta] = None,
    hints: Optional[dict[str, str]] = None,
) -> ReconfigureOptions:
    return ReconfigureOptions(uuid=uuid, handles=handles, timeout=timeout, hints=dict(hints or {}))

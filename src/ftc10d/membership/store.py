"""The ``MembershipStore`` interface: what agreement needs from a store.

Two backends implement it: :class:`~ftc10d.membership.tcp.TCPMembershipStore`
(torch's C++ ``TCPStore``, the embedded default) and
:class:`~ftc10d.membership.etcd.EtcdMembershipStore` (etcd 3.4+, for HA).
Keys are *logical* (``cfg/7``, ``hb/<id>``); a backend puts them under its
own prefix so that several jobs can share one store.

The primitives are chosen so that no process ever holds a lock: the only
decision point is :meth:`MembershipStore.create`, an atomic create-if-absent
(``compare_set`` on TCPStore, a transaction on etcd). A process that dies
right after it won leaves a complete record behind; one that dies before
leaves nothing. Either way nobody waits for it.

Liveness: a backend with leases (etcd) attaches ``leased=True`` records to the
writer's lease, so they vanish when the writer stops renewing it; TCPStore has
no leases, and there the heartbeat counters alone tell who is alive.

Every method raises :class:`ftc10d.StoreUnavailableError` when the store cannot
be reached (after the backend's own reconnect/failover attempts).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import NamedTuple, Optional

from ftc10d.types import StoreUnavailableError

__all__ = ["MembershipStore", "StoreUnavailableError", "Head", "requests_made"]

_requests = 0
_requests_lock = threading.Lock()


def count_request() -> None:
    """Called by a backend once per round trip to its store."""
    global _requests
    with _requests_lock:
        _requests += 1


def requests_made() -> int:
    """How many requests this process's membership clients (any backend) made so far: tests
    and benchmarks read a store's load from it (TCPStore's server counts nothing)."""
    return _requests


class Head(NamedTuple):
    """What a proposer reads before it writes, in one round trip where the backend can:
    the highest configuration slot, the highest pending record, and the joins logged
    after a sequence number (each slot as (epoch, raw value))."""

    top: Optional[tuple[int, bytes]]
    pending: Optional[tuple[int, bytes]]
    joins: list[tuple[int, str]]


class MembershipStore(ABC):
    """A connection to a membership store. Not shared between threads: each
    thread of a member works on its own :meth:`clone`."""

    #: Backend name for logs and status ("tcp", "etcd").
    kind: str = "?"

    @abstractmethod
    def clone(self) -> "MembershipStore":
        """A new, independent connection to the same store and prefix, sharing this one's lease."""

    @abstractmethod
    def describe(self) -> str:
        """Where this store is, for messages (``tcp://127.0.0.1:29500/prefix``)."""

    # ------------------------------------------------------------ plain keys

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The value of ``key``, or None if it does not exist."""

    @abstractmethod
    def get_many(self, keys: list[str]) -> list[Optional[bytes]]:
        """Values of ``keys`` in one round trip where the backend can (None: absent)."""

    @abstractmethod
    def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        """Write ``key``; with ``leased`` it disappears when this member's lease expires (etcd)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (cheaper than :meth:`get` for big values)."""

    # ------------------------------------------------------- atomic decisions

    @abstractmethod
    def create(self, key: str, value: bytes) -> tuple[bool, bytes]:
        """Atomically create ``key`` if absent. Returns (created, value now stored)."""

    @abstractmethod
    def replace(self, key: str, expected: bytes, value: bytes) -> tuple[bool, bytes]:
        """Atomically set ``key`` to ``value`` iff it holds ``expected``. Returns (swapped, value now stored)."""

    #: Whether :meth:`highest` works (the backend lists keys in order cheaply).
    lists_keys: bool = False

    def highest(self, prefix: str) -> Optional[tuple[int, bytes]]:
        """The key under ``prefix`` with the largest integer suffix (``cfg/<n>``) and its
        value, in one round trip, if the backend lists keys (etcd); None otherwise, and
        callers probe forward from a hint."""
        return None

    def read_head(self, joins_after: int) -> Optional[Head]:
        """See :class:`Head`; None if the backend cannot do it in one round trip."""
        return None

    #: Incremented by the backend each time it had to reconnect to a store that
    #: may have lost its state (a restarted TCPStore); readers re-check the incarnation.
    connection_epoch: int = 0

    # ------------------------------------------------------------------ joins

    @abstractmethod
    def append_join(self, member_id: str) -> None:
        """Append ``member_id`` to the join log (after its ``mem/<id>`` record was written)."""

    @abstractmethod
    def read_joins(self, after: int) -> list[tuple[int, str]]:
        """Join log entries with a sequence number above ``after``, in order, as (seq, member id).
        Sequence numbers only grow: an entry never appears below one already read."""

    # ---------------------------------------------------------------- waiting

    @abstractmethod
    def wait_for(self, key: str, timeout: float, stop: Optional[threading.Event] = None) -> Optional[bytes]:
        """Block until ``key`` exists (or ``timeout`` seconds pass: None) and return its value.
        A new configuration must reach every waiter within milliseconds of its creation
        (an etcd watch; TCPStore: a silent ``check`` every 20 ms), and waiting must log
        nothing: it is a member's normal state. ``stop`` set: return None soon (a closing
        member; a backend that cannot be interrupted returns at ``timeout``)."""

    # ------------------------------------------------------------------ lease

    def keepalive(self) -> None:
        """Renew this member's lease (no-op without leases)."""

    def revoke(self) -> None:
        """Give up this member's lease now, so its leased records vanish at once."""

    def lease(self) -> Optional[int]:
        """The id of this connection's lease, granted if needed (None without leases)."""
        return None

    def lease_at_least(self, seconds: float) -> None:
        """Make the lease, if not granted yet, last at least ``seconds`` unrenewed: a member's
        leased heartbeat must not vanish before its heartbeat timeout (a vanished heartbeat is
        a lapse at once). No-op without leases."""

    def borrow_lease(self, lease_id: int) -> None:
        """Attach this connection's leased records to another process's lease (a node
        agent's, which renews it): they vanish with the node. Never renewed nor revoked here."""

    @property
    def lease_lost(self) -> bool:
        """Whether the lease expired under us (it was not renewed in time)."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Drop the connection (the lease stays until revoked or expired)."""

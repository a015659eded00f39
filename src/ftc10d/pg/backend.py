"""The adapter interface between a generation and the communication library under it.

A :class:`~ftc10d.pg.generation.Generation` is one connected configuration; what carries
its tensors is a :class:`Communicator`: born connected (after the rendezvous), never
repaired, cut off when the generation aborts, dropped when it retires. Everything the
contract needs from a backend goes through these few methods, so that the generation's
bookkeeping (sequence numbers, the pending ops an abort drains, naming the dead peer
through the store, the flight recorder) is the same for every backend.

Adapters (``ADAPTERS``, chosen by ``ProcessGroup(..., backend=...)``):

- ``gloo`` (:mod:`ftc10d.pg.gloo`): ``ProcessGroupGloo``; Gloo has no abort, so
  :meth:`Communicator.cut` shuts its pair sockets down.
- ``nccl`` (:mod:`ftc10d.pg.nccl`): ``ProcessGroupNCCL`` created non-blocking, cut by
  NCCL's own abort; imported only when asked for (it needs CUDA).
- ``gloo-as-nccl`` (:class:`ftc10d.pg.gloo.GlooAsNccl`): Gloo declaring NCCL's abort and wait
  semantics, so that CPU tests run the NCCL paths of the generation over real sockets.
- ``cpu:gloo,cuda:nccl`` (:mod:`ftc10d.pg.channels`): one communicator per device type in the
  same generation, ops dispatched by their tensors' device, as torch does.

Capabilities are class attributes, False/empty by default, like c10d's ``supports*``.
"""

from __future__ import annotations

import threading

import enum
import importlib
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, ClassVar, Optional

import torch.distributed as dist

from ftc10d.types import InvalidOptionError


class FailureKind(str, enum.Enum):
    """What a backend error means for the generation (:meth:`Communicator.classify`)."""

    TIMEOUT = "timeout"  # the op's timeout passed: a peer is frozen, partitioned or slow
    PEER_CLOSED = "peer_closed"  # a connection to a peer failed: it died, or aborted and cut it
    REJECTED_ARGS = "rejected_args"  # the backend refused the arguments: the configuration is fine
    OTHER = "other"  # any other communication error: the configuration is aborted


class Communicator(ABC):
    """One connected backend of one generation (module docstring)."""

    #: The adapter's name: ``ProcessGroup(backend=...)`` and the store prefix ``cfg/<uuid>/<name>``.
    name: ClassVar[str]
    #: The device type whose tensors it carries (``"cpu"``, ``"cuda"``).
    device: ClassVar[str]
    #: Every device type whose tensors it can carry (Gloo: CPU, and CUDA through the host;
    #: NCCL: CUDA only). A two-channel group (:mod:`ftc10d.pg.channels`) dispatches by it.
    carries: ClassVar[frozenset[str]] = frozenset({"cpu"})
    #: Ops whose backend work must be waited exactly once, on a helper thread (Gloo: send/recv,
    #: whose timed wait marks the work failed; reduce-scatter, whose wait does the op's copy).
    helper_wait_ops: ClassVar[frozenset[str]] = frozenset()
    #: Of those, the ops whose work completes only through that wait (never ``is_completed()``,
    #: no future: Gloo's reduce-scatter); they count as done once the helper's wait returned.
    wait_completes_ops: ClassVar[frozenset[str]] = frozenset()
    #: Whether :meth:`cut` makes every pending op fail (Gloo: its sockets are shut). If not
    #: (NCCL: an aborted op's wait returns normally), the abort abandons every op not completed
    #: when it began, so that none returns a torn result as a success.
    cut_fails_ops: ClassVar[bool] = True
    #: Whether a backend wait returns before the op completed (NCCL: it only orders the CUDA
    #: stream): ftc10d's ``Work.wait`` then polls ``is_completed()`` on the CPU, abortably.
    poll_wait: ClassVar[bool] = False

    #: The torch ``Backend`` the generation issues ops on; None once retired.
    backend: Any
    rank: int
    size: int

    @classmethod
    def unavailable(cls) -> str:
        """Why this adapter cannot run in this process ("" when it can): checked when a group is
        created, before anything is registered or connected."""
        return ""

    @classmethod
    @abstractmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> "Communicator":
        """Connect ``size`` ranks through ``store`` (this generation's prefix); called by every
        member once the rendezvous agreed. Raises ``RuntimeError`` if a member never connects
        (the caller types it as ``ReconfigureConnectError``)."""

    @classmethod
    def connect_abandoned(cls, thread: "threading.Thread") -> None:
        """``thread``'s :meth:`connect` was given up by its rendezvous and may stay in the
        backend until its timeout: an adapter that serializes connects must not make the
        next one wait for it (Gloo's fd bookkeeping, :mod:`ftc10d.pg.gloo`)."""

    @abstractmethod
    def cut(self) -> int:
        """Make every pending op of this communicator fail fast; called once, by the aborting
        thread, after the abort hooks. Never raises (the abort drains the pending ops after
        it, and an abort that raised half-way would leave waiters blocked). Returns how many
        connections it cut (for the log)."""

    @abstractmethod
    def classify(self, exc: BaseException) -> FailureKind:
        """What a backend error raised by an op (at issue or in its wait) means."""

    def peer_of(self, text: str) -> Optional[int]:
        """The rank whose connection an error message names, if the backend says (Gloo names
        the endpoint); None otherwise: the generation then reads the store's ``failed`` and
        ``aborted/<rank>`` keys."""
        return None

    def channel_for(self, tensors: Any) -> "Communicator":
        """The communicator an op on ``tensors`` runs on: this one (a two-channel group picks
        by device, :class:`ftc10d.pg.channels.Channels`)."""
        return self

    def channel_for_device(self, device: Any) -> "Communicator":
        """The communicator that carries ``device``'s tensors (None: the CPU one)."""
        return self

    def set_timeout(self, timeout: timedelta) -> None:
        """The ops' timeout, when it differs from the connect timeout."""
        self.backend.set_timeout(timeout)

    def retire(self) -> Any:
        """Drop the backend off this object and return it (the caller releases the last
        reference on a background thread: destroying a backend may block)."""
        backend, self.backend = self.backend, None
        return backend


#: name -> "module:class" of each adapter (imported on first use).
ADAPTERS: dict[str, str] = {
    "gloo": "ftc10d.pg.gloo:GlooCommunicator",
    "nccl": "ftc10d.pg.nccl:NcclCommunicator",
    "gloo-as-nccl": "ftc10d.pg.gloo:GlooAsNccl",
}


def adapter(name: str) -> type[Communicator]:
    """The adapter class for ``ProcessGroup(backend=name)``: an adapter's name, or one per
    device type (``"cpu:gloo,cuda:nccl"``, :mod:`ftc10d.pg.channels`); ``InvalidOptionError``
    if unknown."""
    from ftc10d.pg import channels

    pairs = channels.parse(name)
    if pairs is not None:
        return channels.channels_adapter(name, pairs)
    if name not in ADAPTERS:
        raise InvalidOptionError(f"backend {name!r} is not supported; choose one of {list(ADAPTERS)}, or one "
                                 "per device type, e.g. 'cpu:gloo,cuda:nccl'")
    module, _, cls = ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)

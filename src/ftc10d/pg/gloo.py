"""The Gloo adapter: one ``ProcessGroupGloo`` per configuration, and an abort that works.

Gloo has no abort: an op blocked on a frozen peer waits for the full timeout, and
torch 2.14's ``abort()`` on Gloo is a no-op. What does unblock it is shutting
down the configuration's *pair* sockets (the connections to peers): every op
blocked on them fails within a millisecond with an I/O error, and the Gloo
worker threads drain. The device's *listening* socket is never touched, because
Gloo's event loop treats an error on it as fatal to the process.

Gloo does not expose its sockets, so we find them: the sockets that appear in
``/proc/self/fd`` while the communicator connects are its listener and its
pairs. We remember each pair socket's inode and, at abort, shut down only a
descriptor that still refers to that inode (a closed descriptor number may be
reused by anything else in the meantime). Connecting is serialised by a module
lock so two configurations created by different threads of this process do not
claim each other's sockets -- except behind a connect its rendezvous gave up
(``connect_abandoned``): that one may stay in Gloo until its timeout, and the next
configuration must not wait for it. The next connect then goes ahead without the
lock; sockets the abandoned connect opens meanwhile may be counted as the new
group's, and cutting them at its abort only hastens a connect nobody waits for.

The local endpoints of the pair sockets are published in the store so that a
peer whose connection fails ("Connection closed by peer [10.0.0.2]:41234") can
name the rank that owned that endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

import torch.distributed as dist

from ftc10d.pg.backend import Communicator, FailureKind

logger = logging.getLogger("ftc10d")

_CONNECT_LOCK = threading.Lock()
_connect_holder: Optional[threading.Thread] = None  # the thread in Gloo's constructor, under _CONNECT_LOCK
_abandoned_connects: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # given up, maybe still in Gloo
_abandoned_lock = threading.Lock()


def _enter_connect() -> bool:
    """Take the connect lock, unless its holder is a connect given up by its rendezvous
    (then go ahead without it: False)."""
    global _connect_holder
    while not _CONNECT_LOCK.acquire(timeout=0.05):
        with _abandoned_lock:
            holder = _connect_holder
            if holder is not None and holder in _abandoned_connects and holder.is_alive():
                logger.info("gloo: connecting beside an abandoned connect still in Gloo (%s)", holder.name)
                return False
    _connect_holder = threading.current_thread()
    return True


def _leave_connect(locked: bool) -> None:
    global _connect_holder
    with _abandoned_lock:
        _abandoned_connects.discard(threading.current_thread())
    if locked:
        _connect_holder = None
        _CONNECT_LOCK.release()
_ENDPOINT_RE = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")
#: What Gloo's errors say when a connection to a peer failed.
PEER_ERROR_MARKERS = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused",
                      "Read error", "Write error", "EOF")
#: Gloo's send/recv works: no future (``Work::getFuture not implemented``), and a second
#: backend wait on a completed one blocks until its timeout, so they are waited once
#: (``Work.p2p_backend_wait``).
P2P_OPS = frozenset({"send", "recv", "recv_anysource"})
#: Gloo's reduce-scatter works (both forms, CPU): the result is copied into the output by
#: ``wait()`` itself, on every call; the work never reports ``is_completed()``, has no future,
#: and its wait ignores a timeout (measured on torch 2.11-2.15). So such an op is waited in the
#: backend once, on a helper thread, like send/recv (``p2p_backend_wait``): a second wait would
#: copy the result again over whatever the caller wrote there since (FSDP2 writes the averaged
#: gradient into that very buffer), and a caller stuck in the backend's wait could not be
#: released by an abort (a resumed SIGSTOPped rank waited there for the op's whole timeout).
#: It counts as completed once that wait returned.
WAIT_COMPLETES_OPS = frozenset({"reduce_scatter", "reduce_scatter_tensor"})


def _socket_inodes() -> dict[int, int]:
    """fd -> socket inode for every socket this process has open."""
    out: dict[int, int] = {}
    base = "/proc/self/fd"
    for name in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


@dataclass(frozen=True)
class _PairSocket:
    fd: int
    inode: int
    local: tuple[str, int]
    remote: Optional[tuple[str, int]]  # None for the listener

    @property
    def is_listener(self) -> bool:
        return self.remote is None


@contextlib.contextmanager
def _borrowed_socket(fd: int, inode: int) -> Iterator[Optional[socket.socket]]:
    """A socket object over a duplicate of ``fd`` while it still is the socket ``inode``
    names, else None: Gloo may have closed it, and the process may have reused the number
    for anything (a pipe, another socket). Checked before wrapping: wrapping a non-socket
    raises ENOTSOCK (chaos finding 15). Gloo's own descriptor is never closed here."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    s: Optional[socket.socket] = None
    try:
        if os.fstat(dup).st_ino == inode:
            try:
                s = socket.socket(fileno=dup)
            except OSError:
                s = None
        yield s
    finally:
        if s is not None:
            s.detach()  # ``dup`` is closed below, once
        os.close(dup)


def _describe(fd: int, inode: int) -> Optional[_PairSocket]:
    """Return the record for ``fd`` or None if it is not a TCP socket (pair or listener)."""
    with _borrowed_socket(fd, inode) as s:
        if s is None:
            return None
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            local = s.getsockname()[:2]
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return _PairSocket(fd=fd, inode=inode, local=(str(local[0]), int(local[1])), remote=None)
            remote = s.getpeername()[:2]
        except OSError:
            return None
    return _PairSocket(fd=fd, inode=inode, local=(str(local[0]), int(local[1])),
                       remote=(str(remote[0]), int(remote[1])))


def _create_device() -> dist.ProcessGroupGloo.Device:
    """Same device choice as torch's Gloo (``GLOO_SOCKET_IFNAME`` or the hostname).

    ``create_default_device`` alone ignores ``GLOO_SOCKET_IFNAME`` (torch reads it in
    the Python constructor of ``ProcessGroupGloo``, which we do not use), so it is read
    here; the first interface listed is used."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname)
    return dist.ProcessGroupGloo.create_default_device()


class GlooCommunicator(Communicator):
    """One connected ``ProcessGroupGloo`` and the means to cut it off."""

    name = "gloo"
    device = "cpu"
    carries = frozenset({"cpu", "cuda"})  # CUDA tensors through the host, as torch's Gloo
    helper_wait_ops = P2P_OPS | WAIT_COMPLETES_OPS
    wait_completes_ops = WAIT_COMPLETES_OPS

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> "GlooCommunicator":
        return cls(store, rank, size, timeout)

    @classmethod
    def connect_abandoned(cls, thread: threading.Thread) -> None:
        with _abandoned_lock:
            _abandoned_connects.add(thread)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [_create_device()]
        self.rank = rank
        self.size = size
        self._store = store
        locked = _enter_connect()
        try:
            before = _socket_inodes()
            self.backend = dist.ProcessGroupGloo(store, rank, size, opts)
            after = _socket_inodes()
        finally:
            _leave_connect(locked)
        found = []
        for fd, inode in after.items():
            if before.get(fd) == inode:
                continue
            rec = _describe(fd, inode)
            if rec is not None:
                found.append(rec)
        # The listener is never shut down: Gloo's event loop treats an error on it as fatal.
        self._pairs: tuple[_PairSocket, ...] = tuple(p for p in found if not p.is_listener)
        # Publish our endpoints (listener and our end of every pair) so that a peer can
        # map the endpoint named in a Gloo error to our rank.
        store.set(f"ep/{rank}", ",".join(f"{p.local[0]}:{p.local[1]}" for p in found))

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def classify(self, exc: BaseException) -> FailureKind:
        text = str(exc)
        if "timed out" in text.lower():
            return FailureKind.TIMEOUT
        if any(marker in text for marker in PEER_ERROR_MARKERS):
            return FailureKind.PEER_CLOSED
        if isinstance(exc, (TypeError, ValueError)):
            return FailureKind.REJECTED_ARGS
        return FailureKind.OTHER

    def cut(self) -> int:
        """Shut down every pair socket still open; returns how many were cut.

        Never raises: an abort that raised half-way would leave the configuration's
        pending ops undrained and its waiters blocked (chaos finding 15)."""
        cut = 0
        for p in self._pairs:
            with _borrowed_socket(p.fd, p.inode) as s:
                if s is None:
                    continue  # closed by Gloo, or the number now names something else
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError:
                    pass  # already disconnected
        return cut

    def peer_of(self, message: str) -> Optional[int]:
        """Map the ``[ip]:port`` named in a Gloo error to the rank that owned it."""
        m = _ENDPOINT_RE.search(message)
        if m is None:
            return None
        port = int(m.group(2))
        # Gloo prints the port in network byte order on little-endian hosts; accept both.
        swapped = int.from_bytes(port.to_bytes(2, "big"), "little") if port < 65536 else port
        candidates = {f"{m.group(1)}:{port}", f"{m.group(1)}:{swapped}"}
        try:
            keys = [f"ep/{r}" for r in range(self.size) if r != self.rank]
            # check first: multi_get waits for missing keys, and a restarted store has lost them
            # (the abort would then block for the store's whole timeout)
            if not keys or not self._store.check(keys):
                return None
            values = self._store.multi_get(keys)
        except Exception:  # the store may be gone too; naming the peer is best effort
            logger.debug("could not read peer endpoints", exc_info=True)
            return None
        for key, value in zip(keys, values):
            if candidates & set(value.decode().split(",")):
                return int(key.split("/")[1])
        return None


class GlooAsNccl(GlooCommunicator):
    """Real Gloo declaring NCCL's two semantics that the generation must handle: its abort does
    not fail the pending ops (``cut_fails_ops``: they are abandoned) and a backend wait does not
    wait (``poll_wait``: ftc10d's wait polls completion). The device channel of
    ``cpu:gloo,cuda:gloo-as-nccl``, which proves the two-channel group on CPU
    (:mod:`ftc10d.pg.channels`); not for production (Gloo's real semantics are stricter)."""

    name = "gloo-as-nccl"
    cut_fails_ops = False
    poll_wait = True

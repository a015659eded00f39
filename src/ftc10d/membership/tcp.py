"""TCPStore backend (the embedded default) and the coordinator that hosts it.

torch's C++ ``TCPStore`` is the store: ``compare_set`` is the atomic create
that decides each epoch, ``append`` keeps the join log, and members look for the
next configuration with ``check`` every ``POLL_S`` (20 ms), so a new configuration
reaches every member within 20 ms of its creation (why not the server-pushed
``wait``: see ``TCPMembershipStore.wait_for``). It has no leases: liveness is the
heartbeat counters (``detector.py``).

:class:`Coordinator` hosts the store (the launcher embeds one; ``ftc10d
coordinator --port N`` runs one on its own). It binds to **loopback** unless
given another host, by handing torch a socket it bound itself
(``master_listen_fd``): torch's own server would listen on every interface.
It can also run a detector over *all* members (one ``multi_get`` per poll), so
that at scale members need not watch each other.

The store keeps its state in memory only. If it restarts, members reconnect,
see a new incarnation nonce, rejoin under their ids and re-form a configuration
with a fresh uuid (``Member``); the epoch numbering carries on from the highest
epoch the rejoining members held.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from ftc10d.membership.agreement import Agreement, Configuration, cfg_key, hb_key
from ftc10d.store_connect import connect_client, skip_reverse_dns
from ftc10d.membership.detector import JUDGE_TICK_S, BeatInbox, LapseDetector
from ftc10d.membership.records import Signer
from ftc10d.membership.store import MembershipStore, count_request, requests_made  # noqa: F401 (re-exported)
from ftc10d.types import InvalidOptionError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

DEFAULT_PREFIX = "ftc10d/membership/"
JOIN_LOG = "joins"
T = TypeVar("T")
_CONNECT_LOCK = threading.Lock()
CONNECT_ATTEMPT_S = 2.0


def _is_timeout(exc: BaseException) -> bool:
    return "timeout" in str(exc).lower() and not isinstance(exc, dist.DistNetworkError)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to exactly ``host`` (not every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


class TCPMembershipStore(MembershipStore):
    """A client connection to a membership TCPStore at ``host:port``.

    Reconnects once per call when the connection breaks (the coordinator
    restarted); raises :class:`ftc10d.StoreUnavailableError` if that fails.
    Threads may share one (torch's client runs one request at a time; a node
    agent's threads share their node's connection): a broken connection is
    replaced once, whichever thread saw it break.
    """

    kind = "tcp"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 5.0,
        connect_timeout: float = 2.0,
    ) -> None:
        self.host = host
        self.port = int(port)
        self.prefix = prefix
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.connection_epoch = 0
        #: How often :meth:`wait_for` looks (a node agent of a very large job may look less often).
        self.poll_interval = POLL_S
        self._client: Optional[dist.TCPStore] = None
        self._ever_connected = False
        self._client_lock = threading.Lock()

    def clone(self) -> "TCPMembershipStore":
        twin = TCPMembershipStore(self.host, self.port, prefix=self.prefix, timeout=self.timeout,
                                  connect_timeout=self.connect_timeout)
        twin.poll_interval = self.poll_interval
        return twin

    def describe(self) -> str:
        return f"tcp://{self.host}:{self.port}/{self.prefix}"

    # ------------------------------------------------------------- connection

    def _connect(self) -> dist.TCPStore:
        # A first connection gets a generous deadline; a reconnect is kept short, so that a
        # member notices a dead store within a couple of heartbeats.
        limit = self.connect_timeout if self._ever_connected else max(self.connect_timeout, self.timeout, 12.0)
        client = self._new_client(limit)
        if self._ever_connected:
            self.connection_epoch += 1
            logger.info("membership: reconnected to %s", self.describe())
        self._ever_connected = True
        return client

    def _new_client(self, limit: float) -> dist.TCPStore:
        deadline = time.monotonic() + limit
        while True:
            # Attempts, retried until the deadline, serialized per process (many threads
            # connecting at once fail far more often). ``connect_client`` first turns torch's
            # reverse DNS lookups off (``connect.py``: one in about 25 stalled 5 s here).
            attempt = min(CONNECT_ATTEMPT_S, max(deadline - time.monotonic(), 0.05))
            try:
                with _CONNECT_LOCK:
                    client = connect_client(self.host, self.port, timedelta(seconds=attempt))
                break
            except Exception as exc:
                if time.monotonic() >= deadline:
                    raise StoreUnavailableError(f"membership store {self.describe()} is unreachable: {exc}") from exc
        client.set_timeout(timedelta(seconds=self.timeout))
        return client

    def _call(self, fn: Callable[[dist.TCPStore], T]) -> T:
        count_request()
        for attempt in range(2):
            client = self._client
            if client is None:
                with self._client_lock:
                    if self._client is None:
                        self._client = self._connect()
                    client = self._client
            try:
                return fn(client)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                if _is_timeout(exc):
                    raise
                with self._client_lock:
                    if self._client is client:
                        self._client = None  # broken connection: reconnect once
                if attempt == 1:
                    raise StoreUnavailableError(f"membership store {self.describe()}: {exc}") from exc
        raise AssertionError("unreachable")

    def _k(self, key: str) -> str:
        return self.prefix + key

    # ------------------------------------------------------------------- keys

    def get(self, key: str) -> Optional[bytes]:
        k = self._k(key)

        def op(c: dist.TCPStore) -> Optional[bytes]:
            return c.get(k) if c.check([k]) else None  # get() would block on a missing key

        return self._call(op)

    def get_many(self, keys: list[str]) -> list[Optional[bytes]]:
        if not keys:
            return []
        ks = [self._k(k) for k in keys]

        def op(c: dist.TCPStore) -> list[Optional[bytes]]:
            if c.check(ks):
                return list(c.multi_get(ks))
            present = [k for k in ks if c.check([k])]
            values = dict(zip(present, c.multi_get(present))) if present else {}
            return [values.get(k) for k in ks]

        return self._call(op)

    def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        k = self._k(key)
        self._call(lambda c: c.set(k, value))

    def exists(self, key: str) -> bool:
        k = self._k(key)
        return bool(self._call(lambda c: c.check([k])))

    def create(self, key: str, value: bytes) -> tuple[bool, bytes]:
        k = self._k(key)
        now = self._call(lambda c: c.compare_set(k, "", value))
        return now == value, now

    def replace(self, key: str, expected: bytes, value: bytes) -> tuple[bool, bytes]:
        k = self._k(key)
        now = self._call(lambda c: c.compare_set(k, expected, value))
        return now == value, now

    def append_join(self, member_id: str) -> None:
        k = self._k(JOIN_LOG)
        line = member_id + "\n"
        self._call(lambda c: c.append(k, line))

    def read_joins(self, after: int) -> list[tuple[int, str]]:
        raw = self.get(JOIN_LOG)
        if raw is None:
            return []
        ids = raw.decode(errors="replace").split("\n")
        return [(i + 1, mid) for i, mid in enumerate(ids) if i + 1 > after and mid]

    def wait_for(self, key: str, timeout: float, stop: Optional[threading.Event] = None) -> Optional[bytes]:
        """Block until ``key`` exists, at most ``timeout`` seconds (then None), looking every
        ``POLL_S`` with ``check``.

        Why not the server-pushed ``TCPStore.wait(key, timeout)``: torch's client logs two
        C10D warnings ("waitForInput ... timed out after 5000ms") every time such a wait
        times out, and a member watches for the next configuration for as long as its job
        runs: a warning every few seconds per process for normal operation (issue 14). A
        wait without a timeout cannot be interrupted (a member that closes would leave it
        blocked, and a thread that returns from C++ while the interpreter exits aborts the
        process). ``check`` logs nothing; the price is up to ``POLL_S`` of latency and one
        small request per ``POLL_S`` per waiting member, less than its failure detector's
        polling (``watch_interval``, heartbeat timeout / 40). ``stop`` is looked at every poll."""
        k = self._k(key)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            if stop is not None and stop.is_set():
                return None
            if self._call(lambda c: c.check([k])):
                return self._call(lambda c: c.get(k))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if stop is not None:
                stop.wait(min(self.poll_interval, left))
            else:
                time.sleep(min(self.poll_interval, left))

    def close(self) -> None:
        self._client = None


#: How often ``TCPMembershipStore.wait_for`` looks for its key.
POLL_S = 0.02


# ================================================================ coordinator


def _raise_fd_limit() -> None:
    """A coordinator holds a connection per node agent (and the notifier one more): 4,096 nodes
    are past the usual soft limit of 1,024 open files. Raise it to the hard limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            logger.debug("membership coordinator: open files limit %s -> %s", soft, hard)
    except (ImportError, ValueError, OSError) as exc:
        logger.info("membership coordinator: could not raise the open files limit: %s", exc)


class Coordinator:
    """Hosts the membership TCPStore, bound to ``host`` (loopback by default).

    With ``detect`` it also watches every member's heartbeat and proposes the
    removal of those that lapse (the coordinator is an *authority*, not a
    member: its proposals still obey ``min_members`` and the majority rule).
    With ``notify`` (default) it polls for each new configuration once for the
    whole job and pushes a hint to the node agents (:mod:`ftc10d.membership.notify`).
    The pg's rendezvous may share the same store (``store``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: Optional[str] = None,
        detect: bool = True,
        heartbeat_timeout: float = 1.0,
        watch_interval: Optional[float] = None,
        prefix: str = DEFAULT_PREFIX,
        require_majority: bool = True,
        notify: bool = True,
    ) -> None:
        self.host = host
        self.notify = notify
        self._notifier: Any = None
        self._port = port
        self.prefix = prefix
        self.signer = Signer(token)
        self.detect = detect
        self.heartbeat_timeout = heartbeat_timeout
        self.watch_interval = watch_interval if watch_interval is not None else heartbeat_timeout / 40
        if detect and not 0 < self.watch_interval < heartbeat_timeout / 2:
            # Reads half a timeout apart are the detector's own gap (it was starved or frozen):
            # it would restart every clock at every read and never remove anyone.
            raise InvalidOptionError(
                f"watch_interval={self.watch_interval:g} s must be positive and under half the heartbeat "
                f"timeout ({heartbeat_timeout:g} s); the default is timeout / 40")
        self._beats = BeatInbox()  # each node's newest streamed beat, with its arrival
        self.require_majority = require_majority
        self._master: Optional[dist.TCPStore] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.latest: Optional[Configuration] = None
        self.detections = 0

    def start(self) -> "Coordinator":
        _raise_fd_limit()
        sock = listen_socket(self.host, self._port)
        self._port = sock.getsockname()[1]
        skip_reverse_dns()  # else one lost PTR query stalls the server's event loop 5 s (connect.py)
        self._master = dist.TCPStore(
            self.host, self._port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=60), master_listen_fd=sock.detach(),
        )
        logger.info("membership coordinator listening on %s:%d", self.host, self._port)
        if self.notify:
            from ftc10d.membership.notify import Notifier

            self._notifier = Notifier(self.membership_store(), self.signer, self.host,
                                      on_beat=self._on_beat if self.detect else None).start()
        if self.detect:
            from ftc10d.membership.notify import DETECTOR_KEY

            # Node agents then read their ring less often: this detector reads every heartbeat.
            store = self.membership_store()
            store.put(DETECTOR_KEY, f"{self.watch_interval}".encode())
            store.close()
            self._thread = threading.Thread(target=self._detect_loop, name="ftc10d-coordinator", daemon=True)
            self._thread.start()
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self._port}"

    @property
    def store(self) -> dist.TCPStore:
        """The hosting process's own client of the store (e.g. for a pg's rendezvous)."""
        assert self._master is not None, "start() the coordinator first"
        return self._master

    def membership_store(self, **kwargs: Any) -> TCPMembershipStore:
        return TCPMembershipStore(self.host, self._port, prefix=self.prefix, **kwargs)

    def agreement(self) -> Agreement:
        return Agreement(self.membership_store(), self.signer, require_majority=self.require_majority)

    def close(self) -> None:
        self._stop.set()
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None
        if self._thread is not None:
            self._thread.join(5)
        self._master = None  # the server goes with its last reference

    def __enter__(self) -> "Coordinator":
        return self.start() if self._master is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- detector

    def _on_beat(self, node: str, raw: bytes, when: float) -> None:
        self._beats.put(node, raw, when)

    def _detect_loop(self) -> None:
        agreement = self.agreement()
        store = agreement.store
        detector = LapseDetector(self.signer, self.heartbeat_timeout)
        cur: Optional[Configuration] = None
        unit_ids: tuple[Optional[Configuration], list[str], list[str]] = (None, [], [])
        # Every heartbeat is read every watch_interval; with beats streamed (the notifier), lapses
        # are judged in between, every JUDGE_TICK_S, on what arrived.
        tick = min(self.watch_interval, JUDGE_TICK_S) if self._notifier is not None else self.watch_interval
        next_tick = next_read = time.monotonic()
        proposed: tuple[frozenset[str], float] = (frozenset(), 0.0)
        last_blocked: Optional[str] = None
        while not self._stop.is_set():
            next_tick += tick
            try:
                if cur is None or store.exists(cfg_key(cur.epoch + 1)) or store.connection_epoch != agreement._inc_conn:
                    cur = agreement.latest(hint=None if cur is None else cur.epoch)
                    self.latest = cur
                if cur is not None:
                    # One read per heartbeat unit: a node agent's ranks share their node's heartbeat.
                    if unit_ids[0] is not cur:  # once per configuration (O(ranks))
                        units = list(cur.units)
                        unit_ids = (cur, units, [hb_key(u) for u in units])
                    units = unit_ids[1]
                    self._beats.drain_into(detector)  # first: a streamed beat arrived before this read
                    if time.monotonic() >= next_read:
                        next_read = time.monotonic() + self.watch_interval
                        raws = store.get_many(unit_ids[2])
                        lapsed = set(detector.observe(units, raws, time.monotonic()))
                    else:
                        lapsed = set(detector.judge(time.monotonic())) & cur.unit_order.keys()
                    now = time.monotonic()
                    if lapsed and lapsed == proposed[0] and now - proposed[1] < self.watch_interval:
                        lapsed = set()  # proposed a moment ago (blocked, or not yet applied here)
                    if lapsed:
                        proposed = (frozenset(lapsed), now)
                        self.detections += 1
                        out = agreement.propose({m: "heartbeat" for u in lapsed for m in cur.units.get(u, ())},
                                                reason="coordinator: heartbeat lapsed")
                        if out.blocked and out.blocked != last_blocked:  # once, not every pass
                            logger.warning("membership coordinator: %s", out.blocked)
                        last_blocked = out.blocked
                        cur = out.config
                        self.latest = cur
            except Exception:
                logger.warning("membership coordinator: detector pass failed", exc_info=True)
                cur = None
            time.sleep(max(0.0, next_tick - time.monotonic()))
            if time.monotonic() - next_tick > 1.0:
                next_tick = time.monotonic()  # fell far behind: do not burst


# ====================================================== a store for the pg


class ReconnectingTCPStore(dist.Store):
    """A ``torch.distributed.Store`` over a TCPStore client that reconnects when
    the connection breaks, so a ``ProcessGroup`` built on it can rendezvous again
    after the coordinator restarted (its keys are gone; membership re-forms with
    fresh uuids, so nothing old is needed)."""

    def __init__(self, host: str, port: int, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()
        self._host = host
        self._port = int(port)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._client = self._connect()

    def _connect(self) -> dist.TCPStore:
        # After a store restart every rank reconnects here, and the next rendezvous waits for
        # the slowest of them: no reverse DNS lookup (``connect.py``, finding 37).
        return connect_client(self._host, self._port, self._timeout)

    def clone(self) -> "ReconnectingTCPStore":
        """A second connection to the same store (a thread blocked in ``wait`` holds this one)."""
        return ReconnectingTCPStore(self._host, self._port, self._timeout)

    def _call(self, fn: Callable[[dist.TCPStore], T]) -> T:
        try:
            return self._call_once(fn)
        except Exception as exc:
            # torch's C++ wrappers (PrefixStore, Gloo) replace an exception raised by a Python
            # store with "INTERNAL ASSERT FAILED ... Not implemented": say what it really was.
            # A wait that times out is how sliced waits work (the rendezvous waits in 0.25-s
            # slices): normal operation, not a warning (issue 14).
            logger.log(logging.DEBUG if _is_timeout(exc) else logging.WARNING, "store %s:%d: %s: %s",
                       self._host, self._port, type(exc).__name__, exc)
            raise

    def _call_once(self, fn: Callable[[dist.TCPStore], T]) -> T:
        client = self._client
        try:
            return fn(client)
        except Exception as exc:
            if _is_timeout(exc):
                raise
            with self._lock:
                if self._client is client:
                    self._client = self._connect()
                client = self._client
            return fn(client)

    def set(self, key: str, value: Any) -> None:
        self._call(lambda c: c.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda c: c.get(key))

    def add(self, key: str, value: int) -> int:
        return self._call(lambda c: c.add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(lambda c: c.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda c: c.check(keys))

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self._call(lambda c: c.wait(keys))
        else:
            self._call(lambda c: c.wait(keys, timeout))

    def delete_key(self, key: str) -> bool:
        return self._call(lambda c: c.delete_key(key))

    def num_keys(self) -> int:
        return self._call(lambda c: c.num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda c: c.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call(lambda c: c.multi_set(keys, values))

    def append(self, key: str, value: Any) -> None:
        self._call(lambda c: c.append(key, value))

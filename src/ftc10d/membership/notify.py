"""New-configuration hints from the coordinator to the node agents: one poller per job.

On a TCPStore, a waiter learns of ``cfg/<e+1>`` by polling it (``check`` every
20 ms: TCPStore's server-pushed ``wait`` logs warnings on every timeout, see
``TCPMembershipStore.wait_for``). With one waiter per node that is 50 requests
per second per node, most of a node agent's store load, and a store of 4,096
nodes would serve 200,000 polls a second for nothing. The coordinator hosts the
store, so it polls once for everyone (:class:`Notifier`) and pushes a *hint*,
``{"op": "hint", "epoch": e, "raw": <the record>}``, to every agent connected to
it. The agent verifies the record as it would one read from the store (it is
signed with the job's key): a change costs the store one read for the whole job,
not one per node. A hint is only a wake-up: a forged or lost one costs a read or up
to ``SAFETY_POLL_S`` of latency, never a wrong configuration, and nothing read here
is unpickled.

**Big records are fanned out, paced.** A job's first configuration lists every rank (~1 MB
deflated at 32,768 ranks), and every node needs it at once. Read from the store by 4,096
agents, it made the store process queue a copy per reader (TCPStore's server copies each
reply): the coordinator went past 8 GB and was OOM-killed as the job formed. The notifier
pushes it instead: one frame shared by every connection (a connection's backlog holds views
of it, never copies), sent to ``FANOUT_WINDOW`` agents at a time, the next ones as those
finish: the coordinator holds one copy and ``FANOUT_WINDOW`` socket buffers of it. An agent
that takes nothing of it for ``BIG_TURN_STALL_S`` (frozen) loses its connection and its turn.

The coordinator also announces its detector (``DETECTOR_KEY``): the agents then
read their ring successors' heartbeats less often (:class:`ftc10d.membership.NodeAgent`).

The notifier's port is published in the store (``notify``, under the membership
prefix); an agent that finds none (etcd: its watches push already; an older
coordinator) polls as before.

**Beats on the same connection.** After each heartbeat it wrote to the store, an agent sends
the same signed record to the notifier, ``{"op": "beat", "node": id, "raw": record}``
(best effort: never blocking the beat). The coordinator's detector takes the arrival as the
moment it first saw that counter: the record was in the store by then, so this only makes its
clock more exact, never a node more alive than the store says. A detector that only reads
the store sees a beat up to one read late and judges at reads: at a 10-s timeout (a read of
every node's heartbeat every 250 ms), up to 500 ms past the timeout; reading 4,096 heartbeats
every 25 ms instead cost 28 ms of CPU a read (torch's ``multi_get``), more than a core. With
the beats streamed, a lapse is judged every 25 ms on what arrived, and the store is still read
every timeout / 40 (a node whose stream is down is judged on the store alone).
"""

from __future__ import annotations

import logging
import select
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from ftc10d.membership.agreement import cfg_key
from ftc10d.membership.local import FrameBuffer, b64, encode, unb64
from ftc10d.membership.records import MAX_RECORD_BYTES
from ftc10d.types import MembershipError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: Key (under the membership prefix) holding the notifier's port.
NOTIFY_KEY = "notify"
#: A hinted agent still looks for the next configuration this often, or every heartbeat timeout
#: if that is longer (a lost hint, a dead notifier).
SAFETY_POLL_S = 1.0
#: Key (under the membership prefix) present while the coordinator's detector reads every heartbeat.
DETECTOR_KEY = "detector"
#: Frames up to this size go to every agent at once (a delta is ~100 B + the changed members);
#: bigger ones (full records of big jobs) to ``FANOUT_WINDOW`` agents at a time.
HINT_RECORD_MAX = 64 << 10
#: How many agents receive a big frame at the same time.
FANOUT_WINDOW = 32
#: Bytes of small frames a slow agent may have waiting before the notifier drops its connection
#: (it reconnects); also dropped: an agent two big records behind (it reads the store instead).
MAX_BACKLOG = 1 << 20
MAX_BIG_BEHIND = 2
#: An agent that takes no byte of its big frame for this long gives its turn up (it is frozen,
#: or its network is cut): its connection is dropped, and it reads the record once it is back.
BIG_TURN_STALL_S = 5.0
#: An agent's frames to the notifier are beats (~100 B): more than this unparsed is not an agent.
MAX_INBOUND = 4096
#: Beats an agent keeps unsent while the notifier does not read them (it is frozen): then it skips them.
MAX_BEATS_OUT = 16 << 10

#: ``on_beat(node, record, arrival)``: a beat streamed by a node agent (see the module's doc).
BeatCallback = Callable[[str, bytes, float], None]


class _Outbound:
    """One connection's frames not yet sent, in order: views of frames shared by every
    connection (``(view, big)``), never copies."""

    __slots__ = ("frames", "small", "big", "writing")

    def __init__(self) -> None:
        self.frames: deque[tuple[memoryview, bool]] = deque()
        self.small = 0  # bytes of small frames waiting
        self.big = 0  # big frames waiting (the head one may be partly sent)
        self.writing = False  # registered for EVENT_WRITE


class Notifier:
    """The coordinator's side: polls ``cfg/<e+1>`` and pushes a hint to every connected agent.

    ``store``: a ``TCPMembershipStore`` of the coordinator's own (the notifier's thread owns it);
    ``signer``: the job's (the chain's first record is found through verified records);
    ``host``: the address to listen on (the coordinator's); ``on_beat``: called (on the
    notifier's thread) with each beat an agent streams, unverified: the detector verifies it.
    """

    def __init__(self, store: Any, signer: Any, host: str, poll_interval: float = 0.02,
                 on_beat: Optional[BeatCallback] = None) -> None:
        from ftc10d.membership.agreement import Agreement

        self._store = store
        self._agreement = Agreement(store, signer)
        self.poll_interval = poll_interval
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(4096)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: dict[int, tuple[socket.socket, _Outbound]] = {}
        self._sending_big: set[int] = set()  # connections sending a big frame now (<= FANOUT_WINDOW)
        self._big_turns: deque[int] = deque()  # connections waiting for their turn, in order
        self._waiting: set[int] = set()  # the same, to look up
        self._progress: dict[int, float] = {}  # a connection sending a big frame: when it last took bytes
        self._inbound: dict[int, FrameBuffer] = {}
        self._on_beat = on_beat
        self._sel: Any = None
        self.hints = 0
        self.peak_sending_big = 0  # the most connections sending a big frame at once (tests)
        self._thread = threading.Thread(target=self._loop, name="ftc10d-notifier", daemon=True)

    def start(self) -> "Notifier":
        self._store.put(NOTIFY_KEY, str(self.port).encode())
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(2.0)
        for s, _ in self._conns.values():
            s.close()
        self._conns.clear()
        self._sending_big.clear()
        self._big_turns.clear()
        self._waiting.clear()
        self._sock.close()

    @property
    def connected(self) -> int:
        return len(self._conns)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        epoch: Optional[int] = None
        next_poll = 0.0
        self._sel = sel
        try:
            while not self._stop.is_set():
                try:
                    for key, mask in sel.select(timeout=max(0.0, next_poll - time.monotonic())):
                        if key.data is None:
                            self._accept(sel)
                            continue
                        if mask & selectors.EVENT_READ:
                            self._drain(sel, key.fileobj)  # type: ignore[arg-type]
                        if mask & selectors.EVENT_WRITE and key.data in self._conns:
                            self._flush(key.data)
                    self._admit()
                except Exception:  # one bad connection must not end the hints of every agent
                    logger.warning("membership notifier: serving a connection failed", exc_info=True)
                    self._stop.wait(self.poll_interval)
                if time.monotonic() < next_poll:
                    continue
                # Before the first configuration, look for it less often (several reads each time).
                next_poll = time.monotonic() + (self.poll_interval if epoch is not None else 5 * self.poll_interval)
                try:
                    epoch = self._advance(epoch)
                except StoreUnavailableError:
                    epoch = None
                except Exception:
                    logger.warning("membership notifier: a poll failed", exc_info=True)
                    epoch = None
        finally:
            sel.close()
            self._store.close()

    def _advance(self, epoch: Optional[int]) -> Optional[int]:
        if epoch is None:
            top = self._top()
            if top is None:
                return None
            epoch = top
            self._broadcast(epoch, self._store.get(cfg_key(epoch)))
        while self._store.exists(cfg_key(epoch + 1)):
            epoch += 1
            self._broadcast(epoch, self._store.get(cfg_key(epoch)))
        return epoch

    def _top(self) -> Optional[int]:
        """The newest configuration's epoch now (None before the first)."""
        latest = self._agreement.latest()
        return None if latest is None else latest.epoch

    def _broadcast(self, epoch: int, raw: Optional[bytes] = None) -> None:
        msg: dict[str, Any] = {"op": "hint", "epoch": epoch}
        if raw is not None and len(raw) <= MAX_RECORD_BYTES:
            msg["raw"] = b64(raw)
        view = memoryview(encode(msg))  # one frame for every connection
        big = len(view) > HINT_RECORD_MAX
        # A big frame is announced at once to everyone (it may reach an agent seconds later):
        # an agent that knows its record is on the way waits for it rather than reading it.
        ahead = memoryview(encode({"op": "hint", "epoch": epoch, "follows": True})) if big else None
        self.hints += 1
        for fd, (s, out) in list(self._conns.items()):
            if ahead is not None:
                out.frames.append((ahead, False))
                out.small += len(ahead)
            if (out.big + big > MAX_BIG_BEHIND) or (not big and out.small + len(view) > MAX_BACKLOG):
                self._forget(s)  # far behind (frozen?): it reconnects, and reads what it missed
                continue
            out.frames.append((view, big))
            out.big += big
            out.small += 0 if big else len(view)
            self._flush(fd)
        self._admit()

    def _flush(self, fd: int) -> None:
        """Send what the connection can take now, in order; a big frame waits for its turn."""
        s, out = self._conns[fd]
        while out.frames:
            view, big = out.frames[0]
            if big and fd not in self._sending_big:
                if len(self._sending_big) >= FANOUT_WINDOW:
                    if fd not in self._waiting:
                        self._waiting.add(fd)
                        self._big_turns.append(fd)
                    break
                self._sending_big.add(fd)
                self._progress[fd] = time.monotonic()
                self.peak_sending_big = max(self.peak_sending_big, len(self._sending_big))
            try:
                n = s.send(view)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._forget(s)
                return
            if big and n:
                self._progress[fd] = time.monotonic()
            if n < len(view):
                out.frames[0] = (view[n:], big)
                out.small -= 0 if big else n
                break
            out.frames.popleft()
            if big:
                out.big -= 1
                self._sending_big.discard(fd)
                self._progress.pop(fd, None)
            else:
                out.small -= n
        writing = bool(out.frames) and (not out.frames[0][1] or fd in self._sending_big)
        if writing != out.writing:
            out.writing = writing
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            try:
                self._sel.modify(s, events, fd)
            except (KeyError, ValueError, OSError):
                self._forget(s)

    def _admit(self) -> None:
        """Give the free big-frame turns to the connections waiting for one, in order (first
        taking them from connections that stalled)."""
        if self._sending_big:
            stalled = time.monotonic() - BIG_TURN_STALL_S
            for fd in [fd for fd in self._sending_big if self._progress.get(fd, 0.0) < stalled]:
                conn = self._conns.get(fd)
                if conn is None:
                    self._sending_big.discard(fd)
                else:
                    logger.info("membership notifier: an agent took nothing of a big record for %g s; "
                                "dropping its connection (it reads the record itself)", BIG_TURN_STALL_S)
                    self._forget(conn[0])
        while self._big_turns and len(self._sending_big) < FANOUT_WINDOW:
            fd = self._big_turns.popleft()
            self._waiting.discard(fd)
            if fd in self._conns:
                self._flush(fd)

    def _forget(self, s: socket.socket) -> None:
        self._conns.pop(s.fileno(), None)
        self._inbound.pop(s.fileno(), None)
        self._sending_big.discard(s.fileno())
        self._progress.pop(s.fileno(), None)
        self._waiting.discard(s.fileno())  # its place in _big_turns is skipped
        try:
            self._sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                s, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.register(s, selectors.EVENT_READ, s.fileno())
            except (OSError, ValueError, KeyError):
                s.close()
                continue
            self._conns[s.fileno()] = (s, _Outbound())
            self._inbound[s.fileno()] = FrameBuffer()

    def _drain(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        frames = self._inbound.get(s.fileno())
        if not data or frames is None:
            self._forget(s)
            return
        try:
            msgs = frames.feed(data)
            if frames.buffered > MAX_INBOUND:
                raise MembershipError(f"{frames.buffered} bytes of an unfinished frame")
        except MembershipError as exc:
            logger.info("membership notifier: dropping a connection that is not an agent's: %s", exc)
            self._forget(s)
            return
        now = time.monotonic()
        for m in msgs:
            if (self._on_beat is not None and m.get("op") == "beat" and isinstance(m.get("node"), str)
                    and isinstance(m.get("raw"), str)):
                self._on_beat(m["node"], m["raw"].encode(), now)


class HintClient:
    """An agent's connection to the notifier; :meth:`wait` returns the newest hinted epoch."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise MembershipError(f"cannot reach the coordinator's notifier at {host}:{port}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Non-blocking: the watch thread waits in select, and the beat thread's sends must never
        # block on a notifier that stopped reading (a frozen coordinator).
        self._sock.setblocking(False)
        self._poll = select.poll()  # not select(): a process hosting many agents has fds past 1,024
        self._poll.register(self._sock, select.POLLIN)
        self._frames = FrameBuffer()
        #: Epochs whose record was announced as following (a big one, fanned out paced) and when.
        self.announced: dict[int, float] = {}
        self._out = bytearray()
        self._out_lock = threading.Lock()

    def send_beat(self, node: str, record: bytes) -> None:
        """Stream a heartbeat record the agent just wrote to the store (best effort: a beat
        that cannot be sent now is skipped; the store has it)."""
        frame = encode({"op": "beat", "node": node, "raw": record.decode("ascii", "replace")})
        with self._out_lock:
            if len(self._out) > MAX_BEATS_OUT:
                return
            self._out += frame
            try:
                n = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._out.clear()  # the watch thread sees the connection gone and reconnects
                return
            del self._out[:n]

    def wait(self, timeout: float) -> list[tuple[int, Optional[bytes]]]:
        """The hints that came within ``timeout``: (epoch, its record or None), oldest first;
        empty if none came. A frame still arriving (a big record) is waited for within
        ``timeout``: a caller that reads the store when this returns empty must not do so
        because a pushed record was half-way. Raises OSError when the connection is gone."""
        deadline = time.monotonic() + max(timeout, 0.0)
        out: list[tuple[int, Optional[bytes]]] = []
        while not out:
            if not self._poll.poll(max(deadline - time.monotonic(), 0.0) * 1e3):
                return []
            for _ in range(64):  # what is there now, up to 16 MB, without waiting
                try:
                    data = self._sock.recv(1 << 18)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    raise OSError("the notifier closed the connection")
                try:
                    msgs = self._frames.feed(data)
                except MembershipError as exc:  # not our notifier: the caller polls instead
                    raise OSError(str(exc)) from None
                for m in msgs:
                    if m.get("op") != "hint" or not isinstance(m.get("epoch"), int) or isinstance(m["epoch"], bool):
                        continue
                    if m.get("follows") is True:
                        if len(self.announced) < 64:
                            self.announced[m["epoch"]] = time.monotonic()
                        continue
                    out.append((m["epoch"], unb64(m.get("raw"))))  # no (good) record: the agent reads it
                if len(data) < 1 << 18:
                    break
            if time.monotonic() >= deadline:
                break
        return out

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

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
not one per node. A record over ``HINT_RECORD_MAX`` bytes (a full record of a
big job) is hinted by its epoch only, and read by each agent. A hint is only a
wake-up: a forged or lost one costs a read or up to ``SAFETY_POLL_S`` of latency,
never a wrong configuration, and nothing read here is unpickled.

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
from typing import Any, Callable, Optional

from ftc10d.membership.agreement import cfg_key
from ftc10d.membership.local import FrameBuffer, b64, encode, unb64
from ftc10d.types import MembershipError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: Key (under the membership prefix) holding the notifier's port.
NOTIFY_KEY = "notify"
#: A hinted agent still looks for the next configuration this often, or every heartbeat timeout
#: if that is longer (a lost hint, a dead notifier).
SAFETY_POLL_S = 1.0
#: Key (under the membership prefix) present while the coordinator's detector reads every heartbeat.
DETECTOR_KEY = "detector"
#: Records up to this size travel with their hint (a delta is ~100 B + the changed members).
HINT_RECORD_MAX = 64 << 10
#: Bytes a slow agent may have waiting before the notifier drops its connection (it reconnects).
MAX_BACKLOG = 1 << 20
#: An agent's frames to the notifier are beats (~100 B): more than this unparsed is not an agent.
MAX_INBOUND = 4096
#: Beats an agent keeps unsent while the notifier does not read them (it is frozen): then it skips them.
MAX_BEATS_OUT = 16 << 10

#: ``on_beat(node, record, arrival)``: a beat streamed by a node agent (see the module's doc).
BeatCallback = Callable[[str, bytes, float], None]


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
        self._conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self._inbound: dict[int, FrameBuffer] = {}
        self._on_beat = on_beat
        self._sel: Any = None
        self.hints = 0
        self._thread = threading.Thread(target=self._loop, name="ftc10d-notifier", daemon=True)

    def start(self) -> "Notifier":
        self._store.put(NOTIFY_KEY, str(self.port).encode())
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for s, _ in self._conns.values():
            s.close()
        self._conns.clear()
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
                    for key, _ in sel.select(timeout=max(0.0, next_poll - time.monotonic())):
                        if key.data is None:
                            self._accept(sel)
                        else:
                            self._drain(sel, key.fileobj)  # type: ignore[arg-type]
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
        if raw is not None and len(raw) <= HINT_RECORD_MAX:
            msg["raw"] = b64(raw)
        frame = encode(msg)
        self.hints += 1
        for fd, (s, backlog) in list(self._conns.items()):
            try:
                if backlog:
                    backlog += frame
                    n = s.send(backlog)
                    del backlog[:n]
                else:
                    n = s.send(frame)
                    if n < len(frame):
                        backlog += frame[n:]
                if len(backlog) > MAX_BACKLOG:
                    raise OSError("backlog")
            except (BlockingIOError, InterruptedError):
                backlog += frame
            except OSError:
                self._forget(s)

    def _forget(self, s: socket.socket) -> None:
        self._conns.pop(s.fileno(), None)
        self._inbound.pop(s.fileno(), None)
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
            self._conns[s.fileno()] = (s, bytearray())
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
        empty if none came. Raises OSError when the connection is gone."""
        if not self._poll.poll(max(timeout, 0.0) * 1e3):
            return []
        try:
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        if not data:
            raise OSError("the notifier closed the connection")
        try:
            msgs = self._frames.feed(data)
        except MembershipError as exc:  # not our notifier: the caller polls instead
            raise OSError(str(exc)) from None
        out: list[tuple[int, Optional[bytes]]] = []
        for m in msgs:
            if m.get("op") != "hint" or not isinstance(m.get("epoch"), int) or isinstance(m["epoch"], bool):
                continue
            out.append((m["epoch"], unb64(m.get("raw"))))  # no (good) record: the agent reads it
        return out

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

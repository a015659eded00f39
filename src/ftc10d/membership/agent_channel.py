"""A node agent's end of the local channel: its workers' sockets, on one I/O thread.

One concern, split from ``agent.py``: accept the node's workers on the agent's Unix
socket, read their hellos and beats (each beat answered with whether the agent's own
store heartbeat is fresh), and push them every configuration the agent takes, as the
signed bytes the store holds (:mod:`ftc10d.membership.local` has the framing and the
worker's end). Nothing here goes to the store. A mixin:
:class:`~ftc10d.membership.agent.NodeAgent` owns the state and starts the thread.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Any, Optional

from ftc10d.membership.agreement import Configuration, unit_of
from ftc10d.membership.local import FrameBuffer, b64, encode

logger = logging.getLogger("ftc10d")

#: Bytes a worker may leave unread (it is frozen) before its link is dropped (it then watches the store).
MAX_BACKLOG = 64 << 20


class _Conn:
    """One worker's end of the local channel, as the agent sees it."""

    __slots__ = ("sock", "frames", "out", "member", "pid")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer()
        self.out = bytearray()
        self.member: Optional[str] = None
        self.pid = 0


class LocalChannel:
    """The agent side of the local channel (module docstring)."""

    # owned by NodeAgent.__init__
    id: str
    heartbeat_interval: float
    heartbeat_timeout: float
    _lock: threading.Lock
    _stop: threading.Event
    _listener: Optional[socket.socket]
    _conns: dict[Any, _Conn]
    _cur: Optional[Configuration]
    _cur_raw: Optional[bytes]

    def _io_loop(self) -> None:
        sel = selectors.DefaultSelector()
        assert self._listener is not None
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_r.setblocking(False)
        try:
            while not self._stop.is_set():
                for key, events in sel.select(timeout=1.0):
                    tag = key.data
                    if tag == "accept":
                        self._accept(sel)
                    elif tag == "wake":
                        try:
                            self._wake_r.recv(4096)
                        except BlockingIOError:
                            pass
                    else:
                        conn: _Conn = tag
                        if events & selectors.EVENT_READ:
                            self._read(sel, conn)
                        if events & selectors.EVENT_WRITE:
                            self._flush(sel, conn)
                with self._lock:
                    pending = [c for c in self._conns.values() if c.out]
                for c in pending:
                    self._flush(sel, c)
        finally:
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            with self._lock:
                self._conns[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        with self._lock:
            self._conns.pop(conn.sock.fileno(), None)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.member:
            logger.info("membership: node agent %s: the link of %s (pid %d) closed", self.id, conn.member, conn.pid)

    def _read(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, conn)
            return
        try:
            msgs = conn.frames.feed(data)
        except Exception as exc:
            logger.warning("membership: node agent %s drops a local link: %s", self.id, exc)
            self._drop(sel, conn)
            return
        now = time.monotonic()
        replies = bytearray()
        for msg in msgs:
            op = msg.get("op")
            if op == "hello":
                conn.pid = int(msg["pid"]) if isinstance(msg.get("pid"), int) else 0
                replies += encode({"op": "welcome", "node": self.id, "lease": self._lease})
            elif op == "beat" and isinstance(msg.get("id"), str) and isinstance(msg.get("n"), int):
                mid = msg["id"]
                if unit_of(mid) != self.id:
                    continue  # not one of ours: nothing to vouch for
                first = conn.member is None
                conn.member = mid
                with self._lock:
                    if mid in self._last_seen:
                        self._last_seen[mid] = now
                ok = now - self._store_ok_at < max(2 * self.heartbeat_interval, self.heartbeat_timeout / 2)
                replies += encode({"op": "ack", "n": msg["n"], "ok": ok})
                if first and self._cur is not None:
                    self._send_latest(conn)
        if replies:
            with self._lock:
                conn.out += replies
            self._flush(sel, conn)

    def _send_latest(self, conn: _Conn) -> None:
        """A worker that just linked: the agent's newest record, so that a joiner need not poll."""
        with self._lock:
            cur, raw = self._cur, self._cur_raw
            if cur is not None and raw is not None:
                conn.out += encode({"op": "cfg", "epoch": cur.epoch, "raw": b64(raw)})

    def _flush(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        with self._lock:
            if len(conn.out) > MAX_BACKLOG:
                logger.warning("membership: node agent %s drops the link of %s (pid %d): %d bytes unread",
                               self.id, conn.member, conn.pid, len(conn.out))
                conn.out.clear()
                data = None
            else:
                data = bytes(conn.out[:1 << 20])
        if data is None:
            self._drop(sel, conn)
            return
        sent = 0
        if data:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(sel, conn)
                return
        with self._lock:
            del conn.out[:sent]
            want = bool(conn.out)
            if not want:
                # A drained buffer keeps its capacity: after a 32,768-rank first configuration,
                # ~3 MB per linked rank for the life of the job (found at 4,096 simulated nodes).
                conn.out = bytearray()
        try:
            sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), conn)
        except (KeyError, ValueError):
            pass

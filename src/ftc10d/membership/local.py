"""The local channel between a node agent and its workers: framing and the worker's end.

Why a channel of its own: with one member per rank, each rank asks the store for
the next configuration every 20 ms and reads its ring successors' heartbeats
every 25 ms, so the store's load grows with the rank count. Under ``ftc10d
launch`` the launcher is its node's member (:class:`ftc10d.membership.agent
.NodeAgent`): it alone talks to the store for the node, and its workers talk to
it over a Unix socket -- a heartbeat every ``heartbeat_interval`` (answered, so
that a worker knows its agent and the store behind it are alive) and the
configurations it pushes. Nothing here goes to the store.

Frames are a 4-byte big-endian length and a JSON object: nothing read from the
socket is unpickled (invariant 5), and configuration records travel as the
signed bytes the store holds (base64), verified by the worker as if it had read
them itself.

Messages, worker -> agent: ``{"op": "hello", "pid"}``, ``{"op": "beat", "n", "id"}``.
Agent -> worker: ``{"op": "welcome", "node"}``, ``{"op": "ack", "n", "ok"}`` (``ok``:
the agent's own store heartbeat is fresh), ``{"op": "cfg", "epoch", "raw"}``,
``{"op": "inc"}`` (the store reconnected: look at its incarnation).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Optional

from ftc10d.types import MembershipError

logger = logging.getLogger("ftc10d")

#: Environment variable naming the agent's socket (set by ``ftc10d launch`` for its workers).
NODE_AGENT_ENV = "FTC10D_NODE_AGENT"
#: Frames above this are refused (a configuration of 100,000 members is ~6 MB in full).
MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


class FrameBuffer:
    """Accumulates bytes read from a socket and yields the complete messages in them."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise MembershipError(f"local channel: a frame of {n} bytes (the limit is {MAX_FRAME})")
            if len(self._buf) < 4 + n:
                break
            body = bytes(self._buf[4:4 + n])
            del self._buf[:4 + n]
            try:
                msg = json.loads(body)
            except ValueError as exc:
                raise MembershipError(f"local channel: a frame that is not JSON ({exc})") from None
            if isinstance(msg, dict):
                out.append(msg)
        return out


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def unb64(text: Any) -> Optional[bytes]:
    try:
        return base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except ValueError:
        return None


class NodeLink:
    """A worker's connection to its node agent (one per :class:`Member`).

    A reader thread takes the agent's messages apart: acknowledgements wake
    :meth:`beat`, configurations and store reconnections wake :meth:`wait_config`.
    If the agent goes away (its process died: the worker dies with it by
    ``PR_SET_PDEATHSIG``; or it closed), :attr:`broken` says so and the member
    falls back to the store itself.
    """

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise MembershipError(
                f"cannot reach the node agent at {path} ({exc}); ${NODE_AGENT_ENV} is set by `ftc10d launch`: "
                f"unset it to run with one member per rank") from None
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._frames = FrameBuffer()
        self._acked = 0
        self._ack_ok = False
        self._configs: dict[int, bytes] = {}  # epoch -> raw record pushed by the agent (the newest few)
        self._top = 0  # highest epoch pushed
        self._incs = 0  # store reconnections announced
        self.broken: Optional[str] = None
        node: Optional[str] = None
        lease: Optional[int] = None
        try:
            self._sock.sendall(encode({"op": "hello", "pid": os.getpid()}))
            while node is None:
                data = self._sock.recv(65536)
                if not data:
                    raise MembershipError(f"the node agent at {path} closed the connection before welcoming us")
                for msg in self._frames.feed(data):
                    if msg.get("op") == "welcome" and isinstance(msg.get("node"), str) and msg["node"]:
                        node = msg["node"]
                        lease = msg["lease"] if isinstance(msg.get("lease"), int) else None
        except OSError as exc:  # a timeout included
            self._sock.close()
            raise MembershipError(f"the node agent at {path} did not welcome us within {timeout:g} s ({exc})") from None
        except MembershipError:
            self._sock.close()
            raise
        self.node: str = node
        #: The agent's store lease (etcd), for this rank's leased records: they go with the node.
        self.lease = lease
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name="ftc10d-node-link", daemon=True)
        self._reader.start()

    def _send(self, msg: dict[str, Any], timeout: float = 1.0) -> bool:
        """Send unless the agent has not read what we sent before (frozen): then skip it."""
        try:
            with self._send_lock:
                poll = select.poll()
                poll.register(self._sock, select.POLLOUT)
                if not poll.poll(timeout * 1000):
                    return False
                self._sock.sendall(encode(msg))
            return True
        except OSError as exc:
            self._lost(f"send failed: {exc}")
            return False

    def _lost(self, why: str) -> None:
        with self._cv:
            if self.broken is None:
                self.broken = why
                logger.warning("membership: the link to the node agent %s is lost (%s)", self.path, why)
            self._cv.notify_all()

    def _read_loop(self) -> None:
        while self.broken is None:
            try:
                data = self._sock.recv(1 << 20)
            except OSError as exc:
                self._lost(str(exc))
                return
            if not data:
                self._lost("the agent closed the connection")
                return
            try:
                msgs = self._frames.feed(data)
            except MembershipError as exc:
                self._lost(str(exc))
                return
            with self._cv:
                for msg in msgs:
                    op = msg.get("op")
                    if op == "ack" and isinstance(msg.get("n"), int) and msg["n"] >= self._acked:
                        self._acked, self._ack_ok = msg["n"], bool(msg.get("ok"))
                    elif op == "cfg" and isinstance(msg.get("epoch"), int):
                        raw = unb64(msg.get("raw"))
                        if raw is not None:
                            self._configs[msg["epoch"]] = raw
                            self._top = max(self._top, msg["epoch"])
                            for e in [e for e in self._configs if e < self._top - 32]:
                                del self._configs[e]
                    elif op == "inc":
                        self._incs += 1
                        self._configs.clear()  # epochs of the old incarnation mean nothing now
                        self._top = 0
                self._cv.notify_all()

    def beat(self, n: int, member_id: str, timeout: float) -> Optional[bool]:
        """Send heartbeat ``n`` and wait up to ``timeout`` for its answer: True (the agent
        heartbeats in the store), False (it cannot reach the store), None (no answer)."""
        if self.broken is not None or not self._send({"op": "beat", "n": n, "id": member_id}):
            return None
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._acked < n and self.broken is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._ack_ok if self._acked >= n else None

    @property
    def incs(self) -> int:
        return self._incs

    def wait_config(self, epoch: int, incs: int, timeout: float,
                    stop: Optional[threading.Event] = None) -> tuple[str, Optional[bytes]]:
        """Wait for the record of ``epoch``. Returns ``("cfg", raw)``; ``("later", None)`` if
        the agent pushed a later epoch but not this one (read it from the store); ``("inc",
        None)`` if the store reconnected since ``incs``; ``("broken", None)``; ``("timeout",
        None)``. ``stop`` is looked at every 0.1 s."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if self._incs != incs:
                    return "inc", None
                raw = self._configs.get(epoch)
                if raw is not None:
                    return "cfg", raw
                if self._top > epoch:
                    return "later", None
                if self.broken is not None:
                    return "broken", None
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return "timeout", None
                self._cv.wait(min(left, 0.1))

    def top(self) -> int:
        """The highest epoch the agent pushed."""
        return self._top

    def close(self) -> None:
        with self._cv:
            if self.broken is None:
                self.broken = "closed"
            self._cv.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

"""The TCP path of a window (access type SEPARATE): peers on other hosts, or forced.

Wire format, per (source, destination) connection, every message a fixed
36-byte little-endian header ``<4sHHiqqq``: magic ``FTCW``, version, op,
source rank, and three 64-bit fields whose meaning depends on the op; a PUT is
followed by exactly ``nbytes`` raw bytes of tensor data. Nothing is unpickled:
the server only ever unpacks integers with ``struct`` and copies bytes.

    HELLO   a=token  b=uuid (-1: initial configuration)  c=window index
    PUT     a=registration epoch  b=byte offset in the destination window  c=nbytes
    SIGNAL  a=count (1)
    BYE     a=reason (0: closed, 1: aborted)

The token is a random 63-bit number the server publishes in the generation's
store with its address, so a connection that did not learn it from the store
(a stray client, a peer of another window or generation) is dropped at HELLO.

One connection carries one source's puts and signals in issue order, and the
server thread of that connection applies them in that order, so a put is in
the window before the signal that follows it is counted. Put payloads are
received into a bounded staging buffer and copied into the window chunk by
chunk under the window's in-flight protocol (see ``Window._write``): a sender
frozen in the middle of a put therefore never holds the window busy, and
nothing is written into the window after it was invalidated or deregistered.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket
import struct
import threading
from typing import Optional, Protocol

logger = logging.getLogger("ftc10d")

HDR = struct.Struct("<4sHHiqqq")
MAGIC = b"FTCW"
VERSION = 1
OP_HELLO, OP_PUT, OP_SIGNAL, OP_BYE = 1, 2, 3, 4
BYE_CLOSED, BYE_ABORTED = 0, 1
STAGING = 4 << 20  # bytes received before each copy into the window
HELLO_TIMEOUT_S = 10.0


class Sink(Protocol):
    """What the server delivers into: the owning window."""

    def tcp_put_chunk(self, src: int, epoch: int, byte_offset: int, addr: int, nbytes: int) -> bool: ...

    def tcp_signal(self, src: int) -> None: ...

    def tcp_peer_gone(self, src: int, graceful: bool, aborted: bool) -> None: ...


def interface_address(ifname: str) -> Optional[str]:
    """IPv4 address of a network interface (SIOCGIFADDR), as Gloo's GLOO_SOCKET_IFNAME picks it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def local_addresses() -> tuple[str, list[str]]:
    """(address to bind, addresses to publish, most preferred first).

    ``FTC10D_WINDOW_HOST`` wins; else the interface named by ``GLOO_SOCKET_IFNAME``
    (the one the Gloo communicator uses); else what the hostname resolves to,
    plus loopback for peers on this host.
    """
    host = os.environ.get("FTC10D_WINDOW_HOST")
    if host:
        return host, [host]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        ip = interface_address(ifname)
        if ip:
            return ip, [ip]
    addrs: list[str] = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM):
            ip = str(info[4][0])
            if ip not in addrs:
                addrs.append(ip)
    except OSError:
        pass
    if "127.0.0.1" not in addrs:
        addrs.append("127.0.0.1")
    return "0.0.0.0", addrs


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on a clean EOF before the first byte."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("connection closed in the middle of a message")
        got += k
    return True


def _sendv(sock: socket.socket, bufs: list[memoryview]) -> None:
    """sendall for a list of buffers, with one gather syscall in the common case."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        sent = sock.sendmsg(bufs)
        while sent and bufs:
            if sent >= len(bufs[0]):
                sent -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0


class Server:
    """One window's listener and one thread per connected source."""

    def __init__(self, sink: Sink, size: int, uuid: int, index: int, token: int, label: str) -> None:
        self._sink = sink
        self._size = size
        self._uuid = uuid
        self._index = index
        self._token = token
        self._label = label
        bind, self.addresses = local_addresses()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind, 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False
        t = threading.Thread(target=self._accept_loop, name=f"ftc10d-window{index}-accept", daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._conns.append(conn)
                t = threading.Thread(target=self._serve, args=(conn,), name=f"ftc10d-window{self._index}-rx",
                                     daemon=True)
                self._threads.append(t)
            t.start()

    def _hello(self, conn: socket.socket) -> Optional[int]:
        conn.settimeout(HELLO_TIMEOUT_S)
        hdr = bytearray(HDR.size)
        if not _recv_exact(conn, memoryview(hdr)):
            return None
        magic, version, op, src, token, uuid, index = HDR.unpack(hdr)
        if magic != MAGIC or version != VERSION or op != OP_HELLO:
            logger.warning("%s: dropped a connection that is not an ftc10d window peer", self._label)
            return None
        if token != self._token or uuid != self._uuid or index != self._index or not 0 <= src < self._size:
            logger.warning("%s: dropped a connection with a wrong token, uuid, window or rank (%d)", self._label, src)
            return None
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return int(src)

    def _serve(self, conn: socket.socket) -> None:
        src: Optional[int] = None
        graceful = aborted = False
        try:
            src = self._hello(conn)
            if src is None:
                return
            hdr = bytearray(HDR.size)
            hview = memoryview(hdr)
            staging = bytearray(STAGING)
            sview = memoryview(staging)
            saddr = ctypes.addressof(ctypes.c_char.from_buffer(staging))
            while True:
                if not _recv_exact(conn, hview):
                    return
                magic, version, op, _src, a, b, c = HDR.unpack(hdr)
                if magic != MAGIC or version != VERSION:
                    logger.error("%s: corrupt header from rank %d; closing its connection", self._label, src)
                    return
                if op == OP_PUT:
                    epoch, offset, left = a, b, c
                    if left < 0 or offset < 0:
                        logger.error("%s: malformed put from rank %d; closing its connection", self._label, src)
                        return
                    ok = True
                    while left > 0:
                        n = min(left, STAGING)
                        _recv_exact(conn, sview[:n])
                        if ok:
                            ok = self._sink.tcp_put_chunk(src, epoch, offset, saddr, n)
                        offset += n
                        left -= n
                elif op == OP_SIGNAL:
                    for _ in range(max(1, min(a, 1 << 20))):
                        self._sink.tcp_signal(src)
                elif op == OP_BYE:
                    graceful, aborted = True, a == BYE_ABORTED
                    return
                else:
                    logger.error("%s: unknown op %d from rank %d; closing its connection", self._label, op, src)
                    return
        except (OSError, ReferenceError):
            pass  # reset by the peer, shut down by stop(), or the window is gone
        finally:
            try:
                conn.close()
            except OSError:
                pass
            if src is not None and not self._stopped:
                try:
                    self._sink.tcp_peer_gone(src, graceful, aborted)
                except ReferenceError:
                    pass

    def stop(self, join_timeout: float = 2.0) -> None:
        """Stop accepting and receiving; afterwards nothing more is delivered to the sink."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            conns = list(self._conns)
            threads = list(self._threads)
        for s in [self._listener, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._listener.close()
        except OSError:
            pass
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(join_timeout)
        for s in conns:
            try:
                s.close()
            except OSError:
                pass


class Connection:
    """This rank's connection to one destination's server."""

    def __init__(self, addresses: list[tuple[str, int]], src: int, token: int, uuid: int, index: int,
                 timeout: float) -> None:
        last: Optional[BaseException] = None
        self.sock: Optional[socket.socket] = None
        for host, port in addresses:
            try:
                self.sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
                break
            except OSError as exc:
                last = exc
        if self.sock is None:
            raise ConnectionRefusedError(f"could not connect to any of {addresses}: {last}")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._src = src
        self.lock = threading.Lock()
        self.sock.settimeout(timeout)
        self.sock.sendall(HDR.pack(MAGIC, VERSION, OP_HELLO, src, token, uuid, index))

    def put(self, epoch: int, byte_offset: int, data: memoryview, timeout: float) -> None:
        if self.sock is None:
            raise ConnectionAbortedError("the connection was closed")
        self.sock.settimeout(timeout)
        hdr = HDR.pack(MAGIC, VERSION, OP_PUT, self._src, epoch, byte_offset, len(data))
        if len(data) <= 65536:
            self.sock.sendall(hdr + bytes(data))
        else:
            _sendv(self.sock, [memoryview(hdr), data])

    def signal(self, timeout: float) -> None:
        if self.sock is None:
            raise ConnectionAbortedError("the connection was closed")
        self.sock.settimeout(timeout)
        self.sock.sendall(HDR.pack(MAGIC, VERSION, OP_SIGNAL, self._src, 1, 0, 0))

    def close(self, aborted: bool) -> None:
        """Say goodbye (so the peer tells a departure from a death) and close.

        Another thread may be in the middle of a message: the goodbye is sent only
        if the connection's lock comes free soon, else the socket is just shut down
        (bytes of a goodbye inside a put would corrupt the stream)."""
        sock = self.sock
        if sock is None:
            return
        if self.lock.acquire(timeout=0.5):
            try:
                self.sock = None
                try:
                    sock.settimeout(1.0)
                    sock.sendall(HDR.pack(MAGIC, VERSION, OP_BYE, self._src,
                                          BYE_ABORTED if aborted else BYE_CLOSED, 0, 0))
                except OSError:
                    pass
            finally:
                self.lock.release()
        else:
            self.sock = None
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass


def tensor_bytes(ptr: int, nbytes: int) -> memoryview:
    """A byte view of memory at ``ptr`` (the caller keeps its owner alive)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")

"""Store connections without torch's reverse DNS lookups (finding 37 of docs/reliability.md).

torch's TCPStore formats a socket's address with ``getnameinfo()`` (``formatSockAddr`` in
c10d's ``socket.cpp``) when a client connects (the server's address, on the client's
thread) and when the server accepts one (the client's address, on the server's one event
loop thread): a reverse DNS lookup each time, and an IPv4 peer is an IPv4-mapped IPv6
address that ``/etc/hosts`` does not list, so it goes to the nameserver. Where the
nameserver drops a query now and then, that lookup waits out the resolver's timeout
(5 s by default) whatever timeout the store was given. On the 2-core test VM about one
lookup in 25 does (measured with ``strace``): a client stalled 5 s, or the **store's whole
event loop** stalled 5 s, every client of the job waiting with it. A member connects
rarely, but after a store restart every process of the job reconnects at once, and the
chaos trials in which a 0.7-s restart paused the whole job 5 s were that.

torch has its own way out: the first lookup that *fails* turns the lookups off for the
rest of the process ("we just disable it for the remainder of the job, logging IP
addresses instead", pytorch#159596, torch >= 2.9). :func:`skip_reverse_dns` takes it at
once: on a throwaway thread whose resolver is told to make no attempt (glibc's per-thread
``_res.retry``, restored before the thread ends), it opens a store client, whose one
lookup fails at once; from then on torch makes no lookup in this process. torch says so in
one line of its own (``The hostname of the client socket cannot be retrieved. err=-3``).
The cost: torch's fallback formatting is wrong in the torch versions checked (2.13: it
formats the address of its pointer argument, not the address, and the port unswapped),
so torch's own log and error lines about store sockets (``SocketImpl(... remote=...)``,
"connected to ...") show garbage addresses; ftc10d's messages about a store name its
``host:port`` themselves. The names were only ever used in those lines.

ftc10d calls it before the first store connection it makes in a process (the
coordinator's server, node agents, members, the group store of ``ftc10d.train``'s
bootstrap and of ``ftc10d.init_process_group``, the launcher). Set
``FTC10D_REVERSE_DNS=1`` to keep torch's lookups. Where it cannot work (not glibc, or
lookups of the address do not go to DNS through the thread's resolver: nscd,
nss-resolve) it changes nothing and reports ``"unavailable"``.
"""

from __future__ import annotations

import _socket
import ctypes
import logging
import os
import threading
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger("ftc10d")

#: Set to ``1`` to keep torch's reverse DNS lookups of store peers.
ENV_KEEP = "FTC10D_REVERSE_DNS"

_lock = threading.Lock()
_state: str | None = None  # None (not tried), "off", "kept", "unavailable"


def _glibc_res_state() -> ctypes.c_void_p | None:
    """The calling thread's glibc resolver state (``_res``), initialized; None if not glibc."""
    try:
        libc = ctypes.CDLL(None)
        res_state = libc.__res_state
        res_init = libc.__res_init
    except (OSError, AttributeError):
        return None
    res_state.restype = ctypes.c_void_p
    if res_init() != 0:
        return None
    return res_state()


def _trip() -> bool:
    """On this (throwaway) thread: make one torch address lookup fail, which turns torch's
    lookups off process-wide. ``struct __res_state`` starts with ``int retrans; int retry;``
    (glibc's documented legacy interface, per thread): 0 attempts means the lookup gives up
    at once with ``TRY_AGAIN``, and ``getnameinfo`` returns ``EAI_AGAIN``."""
    state = _glibc_res_state()
    if state is None:
        return False
    retry = ctypes.c_int.from_address(state + ctypes.sizeof(ctypes.c_int))
    saved = retry.value
    retry.value = 0
    try:
        # First, the same lookup with the C library directly (``_socket``: untouched by gevent's
        # patching): it fails only if lookups of this address go to DNS through this thread's
        # resolver. Where they go elsewhere (nscd, nss-resolve, ``files`` only) nothing would fail
        # in torch either: say so rather than claim the switch.
        try:
            _socket.getnameinfo(("::ffff:127.0.0.1", 1), _socket.NI_NUMERICSERV)
            return False
        except _socket.gaierror as exc:
            if exc.errno != _socket.EAI_AGAIN:
                return False
        # The server formats its listening address on this thread, the client the server's.
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        del client, server
    finally:
        retry.value = saved  # under gevent this "thread" is the process's own OS thread
    return True


def skip_reverse_dns() -> str:
    """Turn torch's reverse DNS lookups of store peers off in this process, once (see the
    module docstring). Returns what was done: ``"off"``, ``"kept"`` (``FTC10D_REVERSE_DNS=1``)
    or ``"unavailable"`` (not glibc, or the attempt failed)."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is not None:
            return _state
        if os.environ.get(ENV_KEEP, "") not in ("", "0"):
            _state = "kept"
            return _state
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["ok"] = _trip()
            except Exception as exc:  # noqa: BLE001 - reported below; torch's lookups stay on
                box["exc"] = exc

        thread = threading.Thread(target=run, name="ftc10d-reverse-dns-off", daemon=True)
        try:
            thread.start()
            thread.join()
        except RuntimeError as exc:  # no thread to be had: torch's lookups stay on
            box["exc"] = exc
        if box.get("ok"):
            _state = "off"
            logger.info("torch's reverse DNS lookups of store peers are off in this process (torch's line 'The "
                        "hostname of the client socket cannot be retrieved' says so; %s=1 keeps them)", ENV_KEEP)
        else:
            _state = "unavailable"
            logger.debug("torch's reverse DNS lookups of store peers stay on: %s",
                         box.get("exc", "no glibc resolver state"))
        return _state


def connect_client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore client of ``host:port`` (``is_master=False``), after :func:`skip_reverse_dns`."""
    skip_reverse_dns()
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)

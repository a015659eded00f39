"""What a window holds, and the checks and copies its ops share.

:class:`Resources` is everything of a window the OS must get back (its signal block,
the peers' mapped blocks and pid watches, its TCP server and connections, the
registration and its executor), owned apart from the :class:`~ftc10d.window.window.Window`
so that a finalizer can release it when a window is dropped without being closed.
:class:`Registration` is one registered tensor and the peers' windows as this rank sees
them (:class:`PeerWindow`); :class:`PeerHost` what a peer published at ``new_window``
(which transport reaches it). The checks raise the typed window errors with what to do.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ftc10d.types import InvalidOptionError, WindowError, WindowUsageError
from ftc10d.window import _atomics, _shm, _tcp
from ftc10d.window.work import Executor

#: ``auto`` (default): shared memory with peers on this host, TCP with the others.
#: ``tcp``: TCP with every peer (tests, benchmarks, or hosts where mapping is unwanted).
TRANSPORT_ENV = "FTC10D_WINDOW_TRANSPORT"
TRANSPORTS = ("auto", "tcp")
#: Puts of at least this many bytes into shared memory are split across copy threads.
PARALLEL_COPY_MIN = 8 << 20
#: Copy threads for large shared-memory puts (``FTC10D_WINDOW_COPY_THREADS`` overrides):
#: one copy stream does not saturate a server's memory bandwidth, but on a small
#: machine extra threads only compete with the application.
COPY_THREADS_ENV = "FTC10D_WINDOW_COPY_THREADS"


def transport() -> str:
    value = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise InvalidOptionError(f"{TRANSPORT_ENV}={value!r} is not one of {list(TRANSPORTS)}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def check_tensor(op: str, tensor: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise WindowUsageError(f"{op}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise WindowUsageError(
            f"{op}: {what} is on {tensor.device}; ftc10d windows (Gloo) hold CPU tensors: pass tensor.cpu()"
        )
    return tensor


def as_index(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise WindowUsageError(f"{op}: {name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise WindowUsageError(f"{op}: {name} must be an int, got {type(value).__name__}") from None


_copy_pool: Optional[ThreadPoolExecutor] = None
_copy_pool_lock = threading.Lock()


def copy_threads() -> int:
    text = os.environ.get(COPY_THREADS_ENV, "")
    if text:
        try:
            return max(1, int(text))
        except ValueError:
            raise InvalidOptionError(f"{COPY_THREADS_ENV}={text!r} is not an integer") from None
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def parallel_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for 1-D tensors, split across threads when large
    (``copy_`` releases the GIL, so the chunks really run in parallel)."""
    global _copy_pool
    threads = copy_threads() if dst.numel() * dst.element_size() >= PARALLEL_COPY_MIN else 1
    if threads <= 1:
        dst.copy_(src)
        return
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool._max_workers < threads - 1:  # type: ignore[attr-defined]
            _copy_pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="ftc10d-copy")
        pool = _copy_pool
    bounds = [dst.numel() * i // threads for i in range(threads + 1)]
    futures = [pool.submit(dst[bounds[i]:bounds[i + 1]].copy_, src[bounds[i]:bounds[i + 1]])
               for i in range(1, threads)]
    dst[: bounds[1]].copy_(src[: bounds[1]])
    for f in futures:
        f.result()


def check_layout(op: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise WindowUsageError(
            f"{op}: the tensor is not contiguous; register t = tensor.contiguous() and keep using t "
            "(a window is a flat run of elements, and peers address it by element offset)"
        )


@dataclass
class PeerHost:
    """What the host record of one peer says (published at new_window)."""

    boot: str
    pidns: str
    pid: int
    block_fd: int
    block_inode: int
    cross_process: bool  # its atomics work across processes
    force_tcp: bool


@dataclass
class PeerWindow:
    """One rank's registered tensor, as this rank sees it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int
    itemsize: int
    view: Optional[torch.Tensor] = None  # the peer's memory, when mapped (UNIFIED)
    flat: Optional[torch.Tensor] = None
    mm: Any = None


class Registration:
    def __init__(self, epoch: int, tensor: torch.Tensor, owning: bool, peers: list[PeerWindow]) -> None:
        self.epoch = epoch
        self.peers = peers
        self._strong = tensor if owning else None
        self._weak = weakref.ref(tensor)

    def local(self) -> Optional[torch.Tensor]:
        return self._strong if self._strong is not None else self._weak()

    def release(self) -> None:
        for p in self.peers:
            p.view = p.flat = None
            mm, p.mm = p.mm, None
            if mm is not None:
                try:
                    mm.close()
                except (BufferError, ValueError):
                    pass  # a map_remote_tensor view is still alive: unmapped when it goes
        self._strong = None


class Resources:
    """Everything a window holds that the OS must get back. Owned apart from the
    window so that a finalizer (the window was dropped) can release it."""

    def __init__(self, name: str) -> None:
        self.own: Optional[_shm.Block] = None
        self.peer_blocks: dict[int, _shm.Block] = {}
        self.watches: dict[int, _shm.PidWatch] = {}
        self.server: Optional[_tcp.Server] = None
        self.conns: dict[int, _tcp.Connection] = {}
        self.reg: Optional[Registration] = None
        self.executor = Executor(name)
        self.released = False

    def stop_io(self, aborted: bool) -> None:
        """Stop receiving and say goodbye to TCP peers; safe to call more than once."""
        if self.server is not None:
            self.server.stop()
        for conn in list(self.conns.values()):
            conn.close(aborted)
        self.conns.clear()

    def release(self, state: int = _shm.CLOSED) -> None:
        if self.released:
            return
        self.released = True
        if self.own is not None and _atomics.load(self.own.state_addr) == _shm.VALID:
            _atomics.store(self.own.state_addr, state)
            self.own.wake_all()
        self.executor.close(WindowError("the window was released"))
        self.stop_io(aborted=state == _shm.INVALID)
        if self.reg is not None:
            self.reg.release()
            self.reg = None
        for blk in self.peer_blocks.values():
            blk.close()
        self.peer_blocks.clear()
        for w in self.watches.values():
            w.close()
        self.watches.clear()
        if self.own is not None:
            self.own.close()

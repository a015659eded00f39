"""Cross-process atomics and futexes on shared memory, from Python.

Why this module exists: a signal over shared memory is "the writer bumps a
counter after its data, the reader sees the counter and then reads the data".
That needs (1) an atomic read-modify-write, because several writers may bump
the same word (the in-flight-put count of a window), (2) release/acquire
ordering, so the data is visible before the counter, and (3) a way for the
reader to sleep until the word changes, without burning a core.

(1) and (2) come from GCC's ``libatomic`` (``__atomic_fetch_add_8`` and
friends, sequentially consistent), called through ctypes: each call is a real
``lock xadd`` / ``ldaddal``, i.e. a full barrier, on x86-64 and aarch64 alike,
rather than relying on x86's store ordering. 8-byte atomics are lock-free on
both, so they work between processes (a lock-based fallback would not: its
locks are per process); :data:`AVAILABLE` is False when that cannot be
guaranteed and the window layer then uses its TCP path for every peer.

(3) is the futex, the kernel's "sleep while this shared word still equals v":
``FUTEX_WAIT`` compares the word atomically with going to sleep, so a signal
that lands between the reader's check and its sleep makes the wait return at
once instead of being lost; ``FUTEX_WAKE`` wakes the sleepers. Shared
(non-``PRIVATE``) futexes work across processes on a ``MAP_SHARED`` mapping.
The futex word is the low 32 bits of a 64-bit counter (little-endian hosts).
Where the syscall number is unknown, waiting degrades to polling with a short
sleep (correct, a little slower).

Without lock-free ``libatomic`` the functions below fall back to a lock that
only serialises the threads of this process: still right for a block that no
other process maps, which is all the window layer then uses (every peer goes
over TCP, and only this process's own threads touch its counters).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import platform
import sys
import threading
import time
from typing import Optional

logger = logging.getLogger("ftc10d")

_SEQ_CST = 5
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libatomic() -> Optional[ctypes.CDLL]:
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            lib.__atomic_fetch_add_8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
            lib.__atomic_fetch_add_8.restype = ctypes.c_uint64
            lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.__atomic_load_8.restype = ctypes.c_uint64
            lib.__atomic_store_8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
            lib.__atomic_store_8.restype = None
            lib.__atomic_is_lock_free.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
            lib.__atomic_is_lock_free.restype = ctypes.c_bool
        except AttributeError:
            continue
        if not lib.__atomic_is_lock_free(8, None):
            logger.info("ftc10d windows: 8-byte atomics are not lock-free here; shared memory disabled")
            return None
        return lib
    return None


_lib = _load_libatomic()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

#: Whether blocks may be shared between processes (cross-process atomics available).
AVAILABLE: bool = _lib is not None
#: Whether waits sleep on a futex (else they poll). The futex word is a counter's low half.
HAS_FUTEX: bool = _SYS_FUTEX is not None and sys.byteorder == "little"

if _lib is not None:
    _fetch_add = _lib.__atomic_fetch_add_8
    _load = _lib.__atomic_load_8
    _store = _lib.__atomic_store_8
else:  # process-local fallback (see the module docstring)
    _local_lock = threading.Lock()

    def _fetch_add(addr: int, delta: int, _order: int) -> int:
        with _local_lock:
            word = ctypes.c_uint64.from_address(addr)
            old = word.value
            word.value = (old + delta) & 0xFFFFFFFFFFFFFFFF
            return old

    def _load(addr: int, _order: int) -> int:
        with _local_lock:
            return ctypes.c_uint64.from_address(addr).value

    def _store(addr: int, value: int, _order: int) -> None:
        with _local_lock:
            ctypes.c_uint64.from_address(addr).value = value


def fetch_add(addr: int, delta: int) -> int:
    """Atomically add ``delta`` (mod 2**64) to the u64 at ``addr``; returns the old value. Full barrier."""
    return int(_fetch_add(addr, delta & 0xFFFFFFFFFFFFFFFF, _SEQ_CST))


def load(addr: int) -> int:
    """Sequentially consistent load of the u64 at ``addr``."""
    return int(_load(addr, _SEQ_CST))


def store(addr: int, value: int) -> None:
    """Sequentially consistent store of the u64 at ``addr``."""
    _store(addr, value, _SEQ_CST)


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` equals ``expected`` (at most ``timeout_s``).

    Returns on a wake, a timeout, a signal or a changed word alike: callers
    re-check their condition in a loop. Releases the GIL (ctypes does).
    """
    if not HAS_FUTEX:
        time.sleep(min(timeout_s, 0.0005))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    ret = _libc.syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0),
    )
    if ret < 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait failed: {errno.errorcode.get(err, err)}")


def futex_wake(addr: int, count: int = 0x7FFFFFFF) -> None:
    """Wake up to ``count`` sleepers on the u32 at ``addr``."""
    if not HAS_FUTEX:
        return
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(count), None, None, ctypes.c_int(0),
    )

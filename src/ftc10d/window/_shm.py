"""Same-host plumbing: anonymous shared memory, mapping a peer's memory, host identity.

Why no names: a named segment (``/dev/shm/x``) outlives a process killed
between its creation and its unlink. Here nothing ever has a name: the signal
block is a ``memfd``, and a registered tensor's storage is moved into
shared memory by torch's own ``_share_fd_cpu_`` (what ``Tensor.share_memory_()``
does), which unlinks its segment the moment it is created. A peer on the same
host maps either through ``/proc/<pid>/fd/<fd>`` of the owner, checking the
inode so a recycled descriptor number is never mistaken for it. The kernel
frees the memory when the last descriptor and mapping go, whoever dies and
however (SIGKILL included).

"Same host" means: same kernel boot (``boot_id``) and same pid namespace
(``/proc/<pid>`` must name the owner). Whether ``/proc/<pid>/fd`` may be opened
(same user, no ``hidepid``) is then probed by actually mapping the peer's
signal block; a failed probe falls back to the TCP path for that peer.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import select
import socket
from dataclasses import dataclass
from typing import Optional

import torch

from ftc10d.window import _atomics

logger = logging.getLogger("ftc10d")

LINE = 64  # one cache line per header and per peer slot: no false sharing between writers
MAGIC = 0x57433031_43544646  # "FFTC10CW"
# Block state word values.
VALID = 1
INVALID = 2  # the owner aborted / reconfigured: writers must stop
CLOSED = 3  # the owner released the window normally

# Header words (byte offsets in line 0).
_H_MAGIC = 0
_H_STATE = 8
_H_EPOCH = 16  # current registration number, 0 when no tensor is registered
_H_WAITERS = 24  # threads of the owner sleeping in wait_signal


def host_identity() -> tuple[str, str]:
    """(boot id, pid namespace): equal for two processes iff they can map each other's memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "host:" + socket.gethostname()
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "unknown"
    return boot, pidns


class Block:
    """A window's signal block: header + one line per source rank.

    Slot ``src`` holds ``counter`` (signals received from ``src``, written only
    by ``src`` or by this owner's TCP server on its behalf) and ``active`` (1
    while ``src`` is copying into this owner's window). Every access is a
    sequentially consistent atomic (see ``_atomics``).
    """

    def __init__(self, mm: mmap.mmap, size: int, fd: Optional[int]) -> None:
        self.mm = mm
        self.size = size
        self.fd = fd  # the owner keeps it open while peers may still map the block
        self._anchor = ctypes.c_char.from_buffer(mm)  # an export: released in close()
        self.base = ctypes.addressof(self._anchor)
        self.inode = os.fstat(fd).st_ino if fd is not None else 0

    @staticmethod
    def nbytes(size: int) -> int:
        return LINE * (1 + size)

    @classmethod
    def create(cls, size: int) -> "Block":
        fd = os.memfd_create("ftc10d-window", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, cls.nbytes(size))
            mm = mmap.mmap(fd, cls.nbytes(size))
        except BaseException:
            os.close(fd)
            raise
        blk = cls(mm, size, fd)
        _atomics.store(blk.base + _H_STATE, VALID)
        _atomics.store(blk.base + _H_MAGIC, MAGIC)
        return blk

    @classmethod
    def map_peer(cls, pid: int, fd: int, inode: int, size: int) -> "Block":
        mm = map_fd(pid, fd, inode, cls.nbytes(size))
        blk = cls(mm, size, None)
        blk.inode = inode
        if _atomics.load(blk.base + _H_MAGIC) != MAGIC:
            blk.close()
            raise OSError(f"/proc/{pid}/fd/{fd} is not an ftc10d window block")
        return blk

    # -- words
    def counter(self, src: int) -> int:
        return self.base + LINE * (1 + src)

    def active(self, src: int) -> int:
        return self.base + LINE * (1 + src) + 8

    @property
    def state_addr(self) -> int:
        return self.base + _H_STATE

    @property
    def epoch_addr(self) -> int:
        return self.base + _H_EPOCH

    @property
    def waiters_addr(self) -> int:
        return self.base + _H_WAITERS

    def state(self) -> int:
        return _atomics.load(self.base + _H_STATE)

    def wake_all(self) -> None:
        """Wake this owner's sleepers on every slot (used when the window goes invalid)."""
        if _atomics.HAS_FUTEX:
            for src in range(self.size):
                _atomics.futex_wake(self.counter(src))

    def close_fd(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._anchor = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # still exported somewhere: unmapped when the last export goes


def map_fd(pid: int, fd: int, inode: int, nbytes: int) -> mmap.mmap:
    """Map ``nbytes`` of the shared-memory file that process ``pid`` holds open as ``fd``."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(f)
        if st.st_ino != inode:
            raise OSError(f"/proc/{pid}/fd/{fd} is not the expected object (inode {st.st_ino} != {inode})")
        if st.st_size < nbytes:
            raise OSError(f"/proc/{pid}/fd/{fd} is {st.st_size} bytes, expected at least {nbytes}")
        return mmap.mmap(f, nbytes)
    finally:
        os.close(f)


@dataclass
class SharedStorage:
    """What a peer needs to map a registered tensor's memory."""

    fd: int
    inode: int
    storage_nbytes: int
    byte_offset: int


def share_tensor(tensor: torch.Tensor) -> SharedStorage:
    """Move ``tensor``'s storage into (anonymous) shared memory in place.

    This is ``Tensor.share_memory_()`` with the file-descriptor strategy, whatever
    torch's global sharing strategy: every view of the storage follows, and the
    segment is unlinked as soon as it exists. A storage already shared by
    descriptor keeps its segment.
    """
    st = tensor.untyped_storage()
    fd, _ = st._share_fd_cpu_()
    if fd < 0:
        raise OSError("the storage is a file mapping without a descriptor")
    return SharedStorage(fd, os.fstat(fd).st_ino, st.nbytes(), tensor.storage_offset() * tensor.element_size())


def map_tensor(pid: int, info: SharedStorage, dtype: torch.dtype,
               shape: tuple[int, ...]) -> tuple[mmap.mmap, torch.Tensor]:
    """Map a peer's registered tensor: returns the mapping and a view with the peer's dtype and shape."""
    mm = map_fd(pid, info.fd, info.inode, info.storage_nbytes)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=info.byte_offset)
    return mm, raw.view(dtype).view(shape)


class PidWatch:
    """A pidfd on a same-host peer: tells whether it has exited (even before it is reaped)."""

    def __init__(self, pid: int) -> None:
        self.fd: Optional[int] = None
        try:
            self.fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            logger.debug("pidfd_open(%d) failed; peer death is then seen by timeouts only", pid, exc_info=True)

    def exited(self) -> bool:
        if self.fd is None:
            return False
        try:
            r, _, _ = select.select([self.fd], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(r)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

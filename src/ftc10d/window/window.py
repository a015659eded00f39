"""One-sided RMA windows on CPU: ``put``, ``signal``, ``wait_signal``, ``map_remote_tensor``.

torch 2.14's ``Window`` contract (names and arguments mirrored exactly) on an
ftc10d group, for torch 2.13 and 2.14 alike:

- ``pg.new_window(tensor=None)`` is collective and goes through the group's
  single issue path, so pre/post hooks see ``HookOpName.NEW_WINDOW``.
- ``tensor_register`` / ``tensor_deregister`` are collective. Ranks may register
  tensors of different sizes and dtypes; a put must match the destination's.
- ``put(tensor, dst_rank, target_offset_nelems, async_op)`` writes into the
  destination's window at an element offset. Its data is visible to the
  destination once that rank has waited for a ``signal`` issued after the put.
- ``wait_signal(peer)`` consumes one signal from ``peer``; extra signals stay
  counted for later waits.

Transport, per (source, destination) pair, chosen at ``new_window``:

- **same host** (UNIFIED): the destination's registered tensor is shared memory
  that the source has mapped; a put is a memcpy, ``map_remote_tensor`` a real
  view. Signals are per-source counters in the destination's signal block,
  bumped with a sequentially consistent atomic after the data and slept on with
  a futex (see ``_atomics``).
- **other host, or forced** (SEPARATE): a TCP connection to a small server
  thread of the destination's window, which applies puts and signals in order
  (see ``_tcp``). ``FTC10D_WINDOW_TRANSPORT=tcp`` forces it for every pair.

A window belongs to the generation it was created in. An abort of that
generation (explicit, failure, timeout, or reconfigure) invalidates it at once
through an abort hook: its signal block is marked invalid so peers stop
writing into it, its sleepers wake, its server stops, and every later op
raises :class:`~ftc10d.types.WindowInvalidError`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ftc10d.pg.work import CompletedWork
from ftc10d.types import (
    CollectiveError,
    ErrorType,
    FTC10DError,
    HookOpName,
    InvalidOptionError,
    PeerFailureError,
    PutOptions,
    SignalOptions,
    WaitSignalOptions,
    WindowAccessType,
    WindowAlreadyRegisteredError,
    WindowBoundsError,
    WindowDtypeError,
    WindowError,
    WindowInvalidError,
    WindowNotRegisteredError,
    WindowRankError,
    WindowUsageError,
    make_window_attr,
)
from ftc10d.window import _atomics, _shm, _tcp
from ftc10d.window._resources import (
    TRANSPORT_ENV,
    PeerHost,
    PeerWindow,
    Registration,
    Resources,
    as_index,
    check_layout,
    check_tensor,
    dtype_name,
    parallel_copy,
    parse_dtype,
    transport,
)
from ftc10d.window.work import WindowWork

if TYPE_CHECKING:
    from ftc10d.pg.generation import Generation
    from ftc10d.pg.process_group import ProcessGroup

logger = logging.getLogger("ftc10d")

#: The abort hook every group that creates windows carries (one per group).
ABORT_HOOK_ID = -0x46544331_30445701
#: How long invalidation / deregistration waits for a peer's copy into our window to end.
QUIESCE_TIMEOUT_S = 2.0
#: A sleeping ``wait_signal`` re-checks aborts and peer liveness this often.
WAIT_SLICE_S = 0.05
#: A sleeping ``wait_signal`` asks the store whether its peer aborted this often.
STORE_CHECK_S = 0.5
#: ``wait_signal`` polls this long before it sleeps: a signal already on its way
#: is then picked up without the two context switches of a futex sleep.
SPIN_S = 30e-6
_RECORD_VERSION = "1"
_U64 = 1 << 64

SELF, SHM, TCP = "s", "u", "t"

_window_counters: "weakref.WeakKeyDictionary[Generation, itertools.count[int]]" = weakref.WeakKeyDictionary()
_counters_lock = threading.Lock()


# ---------------------------------------------------------------- group registry


class _GroupWindows:
    """The live windows of one group, invalidated by the group's abort hook."""

    def __init__(self, pg: "ProcessGroup") -> None:
        self.windows: "weakref.WeakSet[Window]" = weakref.WeakSet()
        self._pg = weakref.ref(pg)

    def on_abort(self) -> None:
        pg = self._pg()
        gen = pg.generation if pg is not None else None
        reason = f"{gen.label} was aborted ({gen.abort_reason})" if gen is not None else "the group was aborted"
        for win in list(self.windows):
            win._invalidate(reason)


_groups: "weakref.WeakKeyDictionary[ProcessGroup, _GroupWindows]" = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def _track(pg: "ProcessGroup", win: "Window") -> None:
    with _groups_lock:
        reg = _groups.get(pg)
        if reg is None:
            reg = _GroupWindows(pg)
            _groups[pg] = reg
            try:
                pg.register_abort_hook(ABORT_HOOK_ID, reg.on_abort)
            except InvalidOptionError:
                logger.warning(
                    "abort hook id %d is taken on %r: its windows are invalidated at their next op "
                    "rather than at the abort itself", ABORT_HOOK_ID, pg,
                )
        reg.windows.add(win)


# ------------------------------------------------------------------- new_window


def new_window(pg: "ProcessGroup", tensor: Optional[torch.Tensor] = None) -> "Window":
    """``ProcessGroup.new_window``: collective; every rank calls it in the same order."""
    if tensor is not None:
        check_tensor("new_window", tensor)
        check_layout("new_window", tensor)
    force_tcp = transport() == "tcp"
    made: list[Window] = []

    def create(_backend: Any) -> CompletedWork:
        win = Window(pg, pg.generation, force_tcp)
        try:
            win._connect()
            if tensor is not None:
                win._register(tensor, True, "new_window", 0, inline=None)
        except BaseException:
            win._res.release()
            raise
        made.append(win)
        return CompletedWork()

    inputs = [tensor] if tensor is not None else []
    pg._issue(HookOpName.NEW_WINDOW, "new_window", inputs, [], -1, False, create, [])
    win = made[0]
    _track(pg, win)
    return win


# ----------------------------------------------------------------- the window


class _ServerSink:
    """The server's view of its window, by weak reference: a dropped window is not kept alive."""

    def __init__(self, win: "Window") -> None:
        self._win = weakref.ref(win)

    def _get(self) -> "Window":
        win = self._win()
        if win is None:
            raise ReferenceError("window gone")
        return win

    def tcp_put_chunk(self, src: int, epoch: int, byte_offset: int, addr: int, nbytes: int) -> bool:
        return self._get()._tcp_put_chunk(src, epoch, byte_offset, addr, nbytes)

    def tcp_signal(self, src: int) -> None:
        self._get()._tcp_signal(src)

    def tcp_peer_gone(self, src: int, graceful: bool, aborted: bool) -> None:
        self._get()._tcp_peer_gone(src, graceful, aborted)


class Window:
    """A one-sided communication window of one ftc10d configuration (see the module doc)."""

    def __init__(self, pg: "ProcessGroup", gen: "Generation", force_tcp: bool) -> None:
        with _counters_lock:
            counter = _window_counters.setdefault(gen, itertools.count())
            self._index = next(counter)
        self._pg = weakref.ref(pg)
        self._gen = gen
        self._force_tcp = force_tcp
        self.rank = gen.rank
        self.size = gen.size
        self._label = f"window {self._index} of {gen.label}"
        self._where = f"{self._label} (rank {gen.rank} of {gen.size})"
        self._default_timeout = pg.timeout
        self._prefix = f"win/{self._index}"
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._conn_lock = threading.Lock()  # connecting may wait for a peer: never under _lock
        self._invalid: Optional[str] = None
        self._inflight = 0
        self._paths: list[str] = []
        self._paths_in: list[str] = []
        self._peers: list[PeerHost] = []
        self._consumed = [0] * self.size
        self._wait_locks = [threading.Lock() for _ in range(self.size)]
        self._lost: dict[int, str] = {}
        self._reg_count = 0
        self._res = Resources(f"ftc10d-window{self._index}")
        self._finalizer = weakref.finalize(self, self._res.release)

    # ------------------------------------------------------------- identity

    @property
    def index(self) -> int:
        """n for the n-th window created in this configuration (the same on every rank)."""
        return self._index

    @property
    def uuid(self) -> Optional[int]:
        return self._gen.uuid

    @property
    def valid(self) -> bool:
        return self._invalid is None and not self._gen.aborted

    def __repr__(self) -> str:
        paths = "".join(self._paths) or "?"
        state = "valid" if self.valid else "invalid"
        return f"ftc10d.Window({self._where}, paths={paths}, {state})"

    # -------------------------------------------------------- store exchange

    def _timeout_s(self) -> float:
        pg = self._pg()
        return (pg.timeout if pg is not None else self._default_timeout).total_seconds()

    def _allgather(self, name: str, value: str, what: str) -> list[str]:
        """Every rank's ``value`` through the generation's store. A missing rank
        raises an error whose text says "timed out" (typed by the caller)."""
        store = self._gen.store
        keys = [f"{self._prefix}/{name}/{r}" for r in range(self.size)]
        store.set(keys[self.rank], value)
        timeout = self._timeout_s()
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(
                f"timed out after {timeout:g} s in {what} on {self._label}: rank(s) {missing} did not arrive "
                "(every rank must make the same window calls in the same order)"
            ) from exc
        return [v.decode() for v in store.multi_get(keys)]

    def _connect(self) -> None:
        """Collective part of new_window: meet, pick a path per peer, start a server if needed."""
        res = self._res
        res.own = _shm.Block.create(self.size)
        boot, pidns = _shm.host_identity()
        own = res.own
        record = "|".join([
            _RECORD_VERSION, boot, pidns, str(os.getpid()), str(own.fd), str(own.inode),
            str(int(_atomics.AVAILABLE)), str(int(self._force_tcp)),
        ])
        records = self._allgather("peer", record, "new_window")
        self._peers = [self._parse_peer(r, text) for r, text in enumerate(records)]
        paths = []
        for q, peer in enumerate(self._peers):
            if q == self.rank:
                paths.append(SELF)
                continue
            same_host = (peer.boot, peer.pidns) == (boot, pidns)
            if same_host:
                res.watches[q] = _shm.PidWatch(peer.pid)
            if self._force_tcp or peer.force_tcp or not same_host or not (_atomics.AVAILABLE and peer.cross_process):
                paths.append(TCP)
                continue
            try:
                res.peer_blocks[q] = _shm.Block.map_peer(peer.pid, peer.block_fd, peer.block_inode, self.size)
                paths.append(SHM)
            except OSError as exc:
                logger.info("%s: cannot map rank %d's memory (%s); using TCP with it", self._where, q, exc)
                paths.append(TCP)
        self._paths = paths
        all_paths = self._allgather("paths", "".join(paths), "new_window")
        self._paths_in = [all_paths[q][self.rank] if len(all_paths[q]) == self.size else TCP for q in range(self.size)]
        if TCP in self._paths_in:
            token = secrets.randbits(62) + 1
            res.server = _tcp.Server(_ServerSink(self), self.size, self._uuid_wire, self._index, token, self._where)
            addrs = ",".join(f"{a}:{res.server.port}" for a in res.server.addresses)
            self._gen.store.set(f"{self._prefix}/addr/{self.rank}", f"{_RECORD_VERSION}|{token}|{addrs}")
        # Every peer that maps our block did so before publishing its paths: the
        # descriptor has served its purpose, and the block now lives only in mappings.
        own.close_fd()
        logger.debug("%s: paths %s (s=self, u=shared memory, t=tcp)", self._where, "".join(paths))

    @property
    def _uuid_wire(self) -> int:
        return -1 if self._gen.uuid is None else int(self._gen.uuid)

    def _parse_peer(self, rank: int, text: str) -> PeerHost:
        parts = text.split("|")
        try:
            if parts[0] != _RECORD_VERSION or len(parts) != 8:
                raise ValueError("unexpected format")
            return PeerHost(parts[1], parts[2], int(parts[3]), int(parts[4]), int(parts[5]),
                         parts[6] == "1", parts[7] == "1")
        except (ValueError, IndexError):
            raise WindowError(
                f"new_window on {self._where}: rank {rank} published a window record this version cannot read "
                f"({text[:80]!r}); all ranks must run the same ftc10d version"
            ) from None

    # ------------------------------------------------------------- validity

    def _check_valid(self, op: str, seq: int) -> None:
        if self._invalid is None:
            gen = self._gen
            pg = self._pg()
            if gen.aborted:
                self._invalidate(f"{gen.label} was aborted ({gen.abort_reason})")
            elif pg is None or pg.generation is not gen:
                now = pg.generation.label if pg is not None and pg.generation is not None else "another configuration"
                self._invalidate(f"the group was reconfigured to {now}")
            elif self._res.released:
                self._invalid = "the window was released"
        if self._invalid is not None:
            raise self._invalid_error(op, seq)

    def _invalid_error(self, op: str, seq: int, peer: Optional[int] = None) -> WindowInvalidError:
        gen = self._gen
        return WindowInvalidError(
            f"{op} #{seq} on {self._where}: the window is no longer valid: {self._invalid or gen.abort_reason}. "
            "A window belongs to the configuration it was created in: after reconfigure(), create a new one "
            "with pg.new_window().",
            op=op, seq=seq, uuid=gen.uuid, peer=peer if peer is not None else gen.failed_peer,
            error_type=gen.error_type,
        )

    def _invalidate(self, reason: str) -> None:
        """Mark the window invalid: peers stop writing into it, sleepers wake, the
        server stops, queued ops fail. Idempotent; called from the abort hook."""
        with self._lock:
            if self._invalid is not None:
                return
            self._invalid = reason
            self._inflight += 1  # keeps the memory mapped until we are done with it
            released = self._res.released
        try:
            res = self._res
            own = res.own
            if own is not None and not released:
                _atomics.store(own.state_addr, _shm.INVALID)
                own.wake_all()
            res.executor.close(self._invalid_error("queued op", 0))
            res.stop_io(aborted=True)
            if own is not None and not released:
                self._quiesce(own)
            logger.debug("%s invalidated: %s", self._where, reason)
        finally:
            self._exit()

    def _quiesce(self, own: _shm.Block) -> None:
        """Wait (bounded) until no peer is copying into this window. A writer that
        has died is not waited for; one frozen mid-copy is waited for at most
        QUIESCE_TIMEOUT_S, then logged."""
        deadline = time.monotonic() + QUIESCE_TIMEOUT_S
        for src in range(self.size):
            addr = own.active(src)
            while _atomics.load(addr) != 0:
                watch = self._res.watches.get(src)
                if watch is not None and watch.exited():
                    break
                if time.monotonic() > deadline:
                    logger.error("%s: rank %d is still copying into this window after %.1f s; going on",
                                 self._where, src, QUIESCE_TIMEOUT_S)
                    return
                time.sleep(0.0002)

    def _enter(self, op: str, seq: int) -> None:
        with self._lock:
            self._inflight += 1
        try:
            self._check_valid(op, seq)
        except BaseException:
            self._exit()
            raise

    def _exit(self) -> None:
        with self._lock:
            self._inflight -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        """Give memory back once invalid and no op is inside the window's memory."""
        with self._lock:
            if self._invalid is None or self._inflight > 0 or self._res.released:
                return
        self._res.release(_shm.INVALID)

    # ------------------------------------------------------- failure typing

    def _timeout_error(self, op: str, seq: int, timeout: float, what: str, inline: bool) -> CollectiveError:
        """A window op that timed out is a failure of the configuration, as for a collective."""
        exc = TimeoutError(f"timed out after {timeout:g} s {what} on {self._label}")
        return self._gen.on_failure(op, seq, exc, abort_inline=inline)

    def _abort_generation(self, error_type: Any, reason: str, peer: Optional[int], inline: bool) -> None:
        gen = self._gen
        if inline:
            gen.abort(error_type, reason, peer)
        else:  # on the executor thread: the abort drains works this thread must finish
            threading.Thread(target=gen.abort, args=(error_type, reason, peer),
                             name="ftc10d-abort", daemon=True).start()

    def _peer_reason(self, q: int) -> Optional[str]:
        try:
            store = self._gen.store
            if store.check([f"aborted/{q}"]):
                return store.get(f"aborted/{q}").decode()
        except Exception:
            logger.debug("could not read why rank %d aborted", q, exc_info=True)
        return None

    def _peer_failure(self, op: str, seq: int, q: int, dead: bool, detail: str, inline: bool) -> CollectiveError:
        """Type a peer's death (PeerFailureError) or departure (WindowInvalidError),
        report it to the group's error listeners and abort the configuration, like
        a failed collective."""
        gen = self._gen
        if gen.aborted or self._invalid is not None:
            return self._invalid_error(op, seq, q)
        where = f"{op} #{seq} on {self._where}"
        err: CollectiveError
        if dead:
            try:
                gen.store.compare_set("failed", "", str(q))
            except Exception:
                logger.debug("could not record the failed peer", exc_info=True)
            err = PeerFailureError(
                f"{where} failed: peer rank {q} {detail}. The configuration was aborted; reconfigure "
                "without the failed member to continue.",
                op=op, seq=seq, uuid=gen.uuid, peer=q, error_type=ErrorType.REMOTE_ERROR,
            )
            reason = f"{op} #{seq} failed: PeerFailureError (peer rank {q})"
        else:
            why = self._peer_reason(q) or detail
            err = WindowInvalidError(
                f"{where}: peer rank {q} aborted the configuration ({why}). Reconfigure the group with a "
                "fresh uuid and create a new window.",
                op=op, seq=seq, uuid=gen.uuid, peer=q, error_type=ErrorType.REMOTE_ERROR,
            )
            reason = f"peer rank {q} aborted the configuration ({why})"
        if gen.on_error is not None:
            try:
                gen.on_error(err)
            except Exception:
                logger.exception("error listener raised; ignored")
        self._abort_generation(err.error_type, reason, q if dead else None, inline)
        return err

    def _connection_failure(self, op: str, seq: int, q: int, exc: BaseException, timeout: float,
                            inline: bool) -> CollectiveError:
        if isinstance(exc, socket.timeout):
            return self._timeout_error(op, seq, timeout, f"sending to rank {q}", inline)
        if self._peer_reason(q) is not None:
            return self._peer_failure(op, seq, q, False, "it closed its window", inline)
        return self._peer_failure(op, seq, q, True, f"closed its connection: it died or was killed ({exc})", inline)

    # ------------------------------------------------------------- arguments

    def _rank(self, op: str, name: str, value: Any) -> int:
        q = as_index(op, name, value)
        if not 0 <= q < self.size:
            raise WindowRankError(
                f"{op}: {name}={q} is not a rank of {self._where}: valid ranks are 0..{self.size - 1}. Ranks "
                "are those of the window's configuration (pg.rank()/pg.size() when it was created)."
            )
        return q

    def _op_timeout(self, op: str, opts: Any, kind: Any) -> float:
        if opts is None:
            return self._timeout_s()
        if not hasattr(opts, "timeout") or not hasattr(opts, "hints"):
            raise InvalidOptionError(f"{op}: opts must be {kind.__name__} or None, got {type(opts).__name__}")
        hints = dict(opts.hints or {})
        if hints:
            raise InvalidOptionError(f"{op}: unknown hints {sorted(hints)}; supported: none")
        t = opts.timeout
        if t is None or t <= timedelta(0):
            return self._timeout_s()
        return t.total_seconds()

    def _registration(self, op: str) -> Registration:
        reg = self._res.reg
        if reg is None:
            raise WindowNotRegisteredError(
                f"{op} on {self._where}: no tensor is registered. Call window.tensor_register(tensor) on "
                "every rank (it is collective), or create the window with pg.new_window(tensor), first."
            )
        return reg

    # ------------------------------------------------------------ running ops

    def _run(self, op: str, seq: int, job: Callable[[bool], None], async_op: bool, result: Any) -> WindowWork:
        ex = self._res.executor
        if not async_op and ex.idle():
            job(True)
            return WindowWork(op, seq, self._label, result, self._work_wait_timeout, done=True)
        work = WindowWork(op, seq, self._label, result, self._work_wait_timeout)
        try:
            ex.submit(work, job)
        except WindowError:
            raise self._invalid_error(op, seq) from None
        if not async_op:
            work.wait()
            return work
        self._gen.track(work)
        return work

    def _work_wait_timeout(self, work: WindowWork, timeout: timedelta) -> CollectiveError:
        return self._timeout_error(work.op, work.seq, timeout.total_seconds(), "in Work.wait()", True)

    # --------------------------------------------------------- registration

    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Collectively register this rank's window memory (every rank, same order).

        On a rank that some peer reaches through shared memory, the tensor's storage is
        moved into shared memory in place (as ``Tensor.share_memory_()`` does, so every
        view of it follows); from then on, peers' puts land in it. With ``owning=True``
        the window keeps the tensor alive until it is deregistered.
        """
        seq = next(self._seq)
        self._check_valid("tensor_register", seq)
        check_tensor("tensor_register", tensor)
        check_layout("tensor_register", tensor)
        self._enter("tensor_register", seq)
        try:
            self._register(tensor, bool(owning), "tensor_register", seq, inline=True)
        finally:
            self._exit()

    def _register(self, tensor: torch.Tensor, owning: bool, op: str, seq: int, inline: Optional[bool]) -> None:
        res = self._res
        if res.reg is not None:
            raise WindowAlreadyRegisteredError(
                f"{op} on {self._where}: a tensor is already registered. Call tensor_deregister() on every "
                "rank first (it is collective), or create another window with pg.new_window()."
            )
        info: Optional[_shm.SharedStorage] = None
        if SHM in self._paths_in and tensor.numel() > 0:
            try:
                info = _shm.share_tensor(tensor)
            except (OSError, RuntimeError) as exc:
                raise WindowUsageError(
                    f"{op} on {self._where}: cannot move the tensor's memory into shared memory ({exc}); "
                    "register a tensor allocated by torch (torch.empty/zeros...), not a file mapping"
                ) from exc
        epoch = self._reg_count + 1
        own = res.own
        assert own is not None
        # Installed before any peer can learn of it: a TCP put may arrive as soon as
        # the slowest peer's exchange completes, before ours returns.
        reg = Registration(epoch, tensor, owning, [])
        res.reg = reg
        self._reg_count = epoch
        _atomics.store(own.epoch_addr, epoch)
        record = "|".join([
            _RECORD_VERSION, dtype_name(tensor.dtype), ",".join(str(d) for d in tensor.shape),
            str(info.fd if info else -1), str(info.inode if info else 0),
            str(info.storage_nbytes if info else 0), str(info.byte_offset if info else 0),
        ])
        try:
            records = self._allgather(f"reg/{epoch}", record, op)
            for q, text in enumerate(records):
                reg.peers.append(self._peer_window(q, text))
        except BaseException as exc:
            _atomics.store(own.epoch_addr, 0)
            self._quiesce(own)
            res.reg = None
            reg.release()
            if isinstance(exc, TimeoutError) and inline is not None:
                raise self._timeout_error(op, seq, self._timeout_s(), "waiting for every rank to register",
                                          inline) from exc
            raise  # inside new_window the issue path types a timeout

    def _peer_window(self, q: int, text: str) -> PeerWindow:
        parts = text.split("|")
        try:
            if parts[0] != _RECORD_VERSION or len(parts) != 7:
                raise ValueError("unexpected format")
            dtype = parse_dtype(parts[1])
            shape = tuple(int(d) for d in parts[2].split(",")) if parts[2] else ()
            if any(d < 0 for d in shape):
                raise ValueError("negative size")
            info = _shm.SharedStorage(int(parts[3]), int(parts[4]), int(parts[5]), int(parts[6]))
        except (ValueError, IndexError):
            raise WindowError(
                f"tensor_register on {self._where}: rank {q} published a registration this version cannot read "
                f"({text[:80]!r}); all ranks must run the same ftc10d version"
            ) from None
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        pw = PeerWindow(dtype, shape, numel, itemsize)
        if self._paths[q] == SHM and numel > 0:
            if info.fd < 0:
                raise WindowError(f"tensor_register on {self._where}: rank {q} did not share its memory")
            try:
                pw.mm, pw.view = _shm.map_tensor(self._peers[q].pid, info, dtype, shape)
            except OSError as exc:
                raise WindowError(
                    f"tensor_register on {self._where}: cannot map rank {q}'s window memory ({exc})"
                ) from exc
            pw.flat = pw.view.view(-1)
        return pw

    def tensor_deregister(self) -> None:
        """Collectively drop the registered tensor (every rank). Pending ops of this
        rank finish first; afterwards no peer writes into the tensor."""
        seq = next(self._seq)
        self._check_valid("tensor_deregister", seq)
        reg = self._registration("tensor_deregister")
        self._res.executor.flush()
        self._enter("tensor_deregister", seq)
        try:
            self._deregister(seq, reg)
        finally:
            self._exit()

    def _deregister(self, seq: int, reg: Registration) -> None:
        own = self._res.own
        assert own is not None
        _atomics.store(own.epoch_addr, 0)
        self._quiesce(own)
        try:
            self._allgather(f"dereg/{reg.epoch}", "1", "tensor_deregister")
        except TimeoutError as exc:
            raise self._timeout_error("tensor_deregister", seq, self._timeout_s(),
                                      "waiting for every rank to deregister", True) from exc
        finally:
            self._res.reg = None
            reg.release()

    # ------------------------------------------------------------------ put

    def put(self, tensor: torch.Tensor, dst_rank: int, target_offset_nelems: int, async_op: bool,
            opts: Any = None) -> WindowWork:
        """Write ``tensor`` into ``dst_rank``'s window at element ``target_offset_nelems``.

        The data is visible to ``dst_rank`` once it has waited for a signal this rank
        issues after the put. Do not modify ``tensor`` before an async put completes.
        """
        op = "put"
        seq = next(self._seq)
        self._check_valid(op, seq)
        dst = self._rank(op, "dst_rank", dst_rank)
        check_tensor(op, tensor)
        off = as_index(op, "target_offset_nelems", target_offset_nelems)
        reg = self._registration(op)
        peer = reg.peers[dst]
        if tensor.dtype != peer.dtype:
            raise WindowDtypeError(
                f"put #{seq} on {self._where}: tensor dtype {tensor.dtype} does not match rank {dst}'s window "
                f"dtype {peer.dtype}; convert it first (tensor.to({peer.dtype}))"
            )
        n = tensor.numel()
        if off < 0 or off + n > peer.numel:
            fit = f"offsets 0..{peer.numel - n} fit" if n <= peer.numel else "no offset fits: split the put"
            raise WindowBoundsError(
                f"put #{seq} on {self._where}: {n} element(s) at offset {off} do not fit rank {dst}'s window of "
                f"{peer.numel} element(s) ({fit}; offsets count destination elements)"
            )
        timeout = self._op_timeout(op, opts, PutOptions)
        src = tensor.reshape(-1)

        def job(inline: bool) -> None:
            self._enter(op, seq)
            try:
                self._do_put(seq, reg, src, dst, off, timeout, inline)
            finally:
                self._exit()

        return self._run(op, seq, job, bool(async_op), [tensor])

    def _do_put(self, seq: int, reg: Registration, src: torch.Tensor, dst: int, off: int, timeout: float,
                inline: bool) -> None:
        if self._res.reg is not reg:
            raise WindowNotRegisteredError(
                f"put #{seq} on {self._where}: the tensor was deregistered before the put ran")
        n = src.numel()
        path = self._paths[dst]
        if path == TCP:
            self._check_lost("put", seq, dst, inline)
            data = src.contiguous()
            conn = self._connection("put", seq, dst, timeout, inline)
            try:
                with conn.lock:
                    conn.put(reg.epoch, off * data.element_size(), _tcp.tensor_bytes(data.data_ptr(), data.nbytes),
                             timeout)
            except OSError as exc:
                raise self._connection_failure("put", seq, dst, exc, timeout, inline) from exc
            return
        if n == 0:
            return
        if path == SELF:
            local = reg.local()
            if local is None:
                raise WindowNotRegisteredError(
                    f"put #{seq} on {self._where}: the tensor registered with owning=False was freed"
                )
            target = local.view(-1)
            blk = self._res.own
        else:
            target = reg.peers[dst].flat
            blk = self._res.peer_blocks.get(dst)
        assert blk is not None and target is not None
        status = self._write(blk, reg.epoch, lambda: parallel_copy(target[off:off + n], src))
        if status == "state":
            raise self._peer_left("put", seq, dst, blk, inline)
        if status == "epoch":
            raise WindowNotRegisteredError(
                f"put #{seq} on {self._where}: rank {dst} deregistered its tensor before the put landed "
                "(tensor_deregister is collective: finish puts and signals first)"
            )

    def _write(self, blk: _shm.Block, epoch: int, copy: Callable[[], Any]) -> str:
        """Copy into a window under its in-flight protocol.

        Announce the copy in our ``active`` slot of the destination's block, then check
        its state and registration epoch, then copy, then retract. The owner, when it
        invalidates or deregisters, first changes state/epoch and then waits for every
        ``active`` slot to drop to 0. All four steps are sequentially consistent, so
        either we see the change and do not copy, or the owner sees us and waits.
        """
        slot = blk.active(self.rank)
        _atomics.fetch_add(slot, 1)
        try:
            if _atomics.load(blk.state_addr) != _shm.VALID:
                return "state"
            if _atomics.load(blk.epoch_addr) != epoch:
                return "epoch"
            copy()
            return "ok"
        finally:
            _atomics.fetch_add(slot, _U64 - 1)

    def _peer_left(self, op: str, seq: int, q: int, blk: _shm.Block, inline: bool) -> FTC10DError:
        if q == self.rank:
            return self._invalid_error(op, seq)
        state = blk.state()
        if state == _shm.CLOSED:
            return WindowError(
                f"{op} #{seq} on {self._where}: rank {q} has released its window (it dropped the Window "
                "object); every rank must keep the window until all ranks are done with it"
            )
        return self._peer_failure(op, seq, q, False, "its window was invalidated", inline)

    # --------------------------------------------------------------- signals

    def signal(self, peer_rank: int, async_op: bool, opts: Any = None) -> WindowWork:
        """Send one signal to ``peer_rank``, ordered after this rank's earlier puts to it."""
        op = "signal"
        seq = next(self._seq)
        self._check_valid(op, seq)
        q = self._rank(op, "peer_rank", peer_rank)
        timeout = self._op_timeout(op, opts, SignalOptions)

        def job(inline: bool) -> None:
            self._enter(op, seq)
            try:
                self._do_signal(seq, q, timeout, inline)
            finally:
                self._exit()

        return self._run(op, seq, job, bool(async_op), [])

    def _do_signal(self, seq: int, q: int, timeout: float, inline: bool) -> None:
        path = self._paths[q]
        if path == TCP:
            self._check_lost("signal", seq, q, inline)
            conn = self._connection("signal", seq, q, timeout, inline)
            try:
                with conn.lock:
                    conn.signal(timeout)
            except OSError as exc:
                raise self._connection_failure("signal", seq, q, exc, timeout, inline) from exc
            return
        blk = self._res.own if path == SELF else self._res.peer_blocks.get(q)
        assert blk is not None
        if blk.state() != _shm.VALID:
            raise self._peer_left("signal", seq, q, blk, inline)
        counter = blk.counter(self.rank)
        _atomics.fetch_add(counter, 1)  # full barrier: the puts before it are visible first
        if _atomics.load(blk.waiters_addr):
            _atomics.futex_wake(counter)

    def wait_signal(self, peer_rank: int, async_op: bool, opts: Any = None) -> WindowWork:
        """Wait for (and consume) one signal from ``peer_rank``; after it, the puts
        ``peer_rank`` issued before that signal are visible in this rank's window."""
        op = "wait_signal"
        seq = next(self._seq)
        self._check_valid(op, seq)
        q = self._rank(op, "peer_rank", peer_rank)
        timeout = self._op_timeout(op, opts, WaitSignalOptions)

        def job(inline: bool) -> None:
            self._enter(op, seq)
            try:
                self._do_wait(seq, q, timeout, inline)
            finally:
                self._exit()

        return self._run(op, seq, job, bool(async_op), [])

    def _do_wait(self, seq: int, q: int, timeout: float, inline: bool) -> None:
        own = self._res.own
        assert own is not None
        addr = own.counter(q)
        with self._wait_locks[q]:
            target = self._consumed[q] + 1
            spin_until = time.perf_counter() + SPIN_S
            while _atomics.load(addr) < target:
                if time.perf_counter() > spin_until:
                    self._sleep_for_signal(seq, q, addr, target, timeout, inline)
                    break
            self._consumed[q] = target

    def _sleep_for_signal(self, seq: int, q: int, addr: int, target: int, timeout: float, inline: bool) -> None:
        own = self._res.own
        assert own is not None
        deadline = time.monotonic() + timeout
        next_store_check = time.monotonic() + STORE_CHECK_S
        _atomics.fetch_add(own.waiters_addr, 1)  # before re-reading the counter (see _do_signal)
        try:
            while True:
                v = _atomics.load(addr)
                if v >= target:
                    return
                now = time.monotonic()
                ask_store = now >= next_store_check
                if ask_store:
                    next_store_check = now + STORE_CHECK_S
                problem = self._wait_problem(seq, q, inline, ask_store)
                if problem is not None:
                    raise problem
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout_error("wait_signal", seq, timeout, f"waiting for a signal from rank {q}",
                                              inline)
                _atomics.futex_wait(addr, v, min(left, WAIT_SLICE_S))
        finally:
            _atomics.fetch_add(own.waiters_addr, _U64 - 1)

    def _wait_problem(self, seq: int, q: int, inline: bool, ask_store: bool = False) -> Optional[BaseException]:
        """Why the signal from ``q`` can never come, if it cannot.

        Local evidence first (our own state, q's pidfd, q's block, q's connection);
        ``ask_store``: also whether q announced an abort in the store, the only
        evidence there is for a TCP peer that never connected to us."""
        op = "wait_signal"
        if self._invalid is not None or self._gen.aborted:
            try:
                self._check_valid(op, seq)
            except WindowInvalidError as exc:
                return exc
        if q == self.rank:
            return None
        watch = self._res.watches.get(q)
        if watch is not None and watch.exited():
            return self._peer_failure(op, seq, q, True, "exited (it died or was killed)", inline)
        blk = self._res.peer_blocks.get(q)
        if blk is not None and blk.state() != _shm.VALID:
            return self._peer_left(op, seq, q, blk, inline)
        lost = self._lost.get(q)
        if lost == "dead":
            return self._peer_failure(op, seq, q, True, "closed its connection: it died or was killed", inline)
        if lost == "aborted":
            return self._peer_failure(op, seq, q, False, "it closed its window", inline)
        if lost == "closed":
            return WindowError(
                f"{op} #{seq} on {self._where}: rank {q} has released its window, so its signal cannot come"
            )
        if ask_store and self._peer_reason(q) is not None:
            return self._peer_failure(op, seq, q, False, "it aborted", inline)
        return None

    # ------------------------------------------------------------ TCP path

    def _check_lost(self, op: str, seq: int, q: int, inline: bool) -> None:
        """A TCP peer that said goodbye (or whose connection to us died) gets nothing more."""
        lost = self._lost.get(q)
        if lost == "dead":
            raise self._peer_failure(op, seq, q, True, "closed its connection: it died or was killed", inline)
        if lost == "aborted":
            raise self._peer_failure(op, seq, q, False, "it closed its window", inline)
        if lost == "closed":
            raise WindowError(f"{op} #{seq} on {self._where}: rank {q} has released its window")

    def _connection(self, op: str, seq: int, q: int, timeout: float, inline: bool) -> _tcp.Connection:
        conn = self._res.conns.get(q)
        if conn is not None:
            return conn
        with self._conn_lock:
            conn = self._res.conns.get(q)
            if conn is not None:
                return conn
            store = self._gen.store
            key = f"{self._prefix}/addr/{q}"
            try:
                store.wait([key], timedelta(seconds=timeout))
                text = store.get(key).decode()
            except Exception as exc:
                raise self._timeout_error(op, seq, timeout, f"waiting for rank {q}'s window address", inline) from exc
            try:
                version, token_s, addrs_s = text.split("|")
                if version != _RECORD_VERSION:
                    raise ValueError(version)
                token = int(token_s)
                addrs = []
                for a in addrs_s.split(","):
                    host, _, port = a.rpartition(":")
                    addrs.append((host, int(port)))
            except ValueError:
                raise WindowError(
                    f"{op} on {self._where}: rank {q}'s window address is unreadable ({text[:80]!r})") from None
            if q in self._res.watches:  # same host: loopback first
                addrs.sort(key=lambda hp: not hp[0].startswith("127."))
            else:  # another host's loopback is our own: never try it
                addrs = [hp for hp in addrs if not hp[0].startswith("127.")] or addrs
            try:
                conn = _tcp.Connection(addrs, self.rank, token, self._uuid_wire, self._index, timeout)
            except OSError as exc:
                raise self._connection_failure(op, seq, q, exc, timeout, inline) from exc
            self._res.conns[q] = conn
            return conn

    def _tcp_put_chunk(self, src: int, epoch: int, byte_offset: int, addr: int, nbytes: int) -> bool:
        """Server thread: copy one received chunk into the window (in-flight protocol)."""
        own = self._res.own
        reg = self._res.reg
        if own is None:
            return False
        slot = own.active(src)
        _atomics.fetch_add(slot, 1)
        try:
            if _atomics.load(own.state_addr) != _shm.VALID:
                return False
            if reg is None or reg.epoch != epoch or _atomics.load(own.epoch_addr) != epoch:
                logger.warning("%s: dropped a put from rank %d for registration %d (current: %s)",
                               self._where, src, epoch, reg.epoch if reg else "none")
                return False
            local = reg.local()
            if local is None:
                return False
            total = local.numel() * local.element_size()
            if byte_offset < 0 or byte_offset + nbytes > total:
                logger.error("%s: rank %d sent a put outside the window (%d+%d > %d bytes); dropped",
                             self._where, src, byte_offset, nbytes, total)
                return False
            ctypes.memmove(local.data_ptr() + byte_offset, addr, nbytes)
            return True
        finally:
            _atomics.fetch_add(slot, _U64 - 1)

    def _tcp_signal(self, src: int) -> None:
        own = self._res.own
        if own is None:
            return
        counter = own.counter(src)
        _atomics.fetch_add(counter, 1)
        if _atomics.load(own.waiters_addr):
            _atomics.futex_wake(counter)

    def _tcp_peer_gone(self, src: int, graceful: bool, aborted: bool) -> None:
        self._lost[src] = "aborted" if aborted else ("closed" if graceful else "dead")
        own = self._res.own
        if own is not None:
            _atomics.futex_wake(own.counter(src))

    # ---------------------------------------------------------- inspection

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """A view of ``rank``'s registered tensor (its dtype and shape), in this
        process's memory map: reads and writes go straight to the peer's memory.
        Only for UNIFIED peers (same host); ``rank == own rank`` returns the local tensor."""
        op = "map_remote_tensor"
        self._check_valid(op, 0)
        q = self._rank(op, "rank", rank)
        reg = self._registration(op)
        if q == self.rank:
            local = reg.local()
            if local is None:
                raise WindowNotRegisteredError(
                    f"{op} on {self._where}: the tensor registered with owning=False was freed")
            return local
        if self._paths[q] == TCP:
            raise WindowUsageError(
                f"{op}({q}) on {self._where}: rank {q} is reached over TCP (access SEPARATE: another host, or "
                f"{TRANSPORT_ENV}=tcp), so its memory cannot be mapped here. Check "
                "window.get_attr(rank).access_type, and use put/signal for SEPARATE peers."
            )
        peer = reg.peers[q]
        if peer.view is None:
            return torch.empty(peer.shape, dtype=peer.dtype)
        return peer.view

    def get_attr(self, peer_rank: int) -> Any:
        """UNIFIED for this rank and peers mapped through shared memory, SEPARATE for TCP peers."""
        self._check_valid("get_attr", 0)
        q = self._rank("get_attr", "peer_rank", peer_rank)
        unified = self._paths[q] in (SELF, SHM)
        return make_window_attr(WindowAccessType.UNIFIED if unified else WindowAccessType.SEPARATE)

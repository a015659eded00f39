"""Generations: one inner communicator per configuration (uuid), and its abort.

A :class:`Generation` is born connected (by :func:`ftc10d.pg.rendezvous.rendezvous`) and
dies aborted; it is never repaired. Everything about failure lives here: translating a
backend error into a typed :class:`~ftc10d.types.CollectiveError`, naming the
failed peer, and aborting so that no op of the generation can write into a user
tensor once :meth:`Generation.abort` has returned (invariant 2). How its members meet
(the store layout of a rendezvous) is :mod:`ftc10d.pg.rendezvous`.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from ftc10d._compat import work_exception
from ftc10d.pg.backend import Communicator, FailureKind
from ftc10d.pg.helpers import ABORT_NOTES
from ftc10d.pg.observer import OpRecord
from ftc10d.pg.work import backend_done, backend_timeout
from ftc10d.types import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicationError,
    ErrorType,
    PeerFailureError,
    ProcessGroupAborted,
)

logger = logging.getLogger("ftc10d")

KEY_ROOT = "ftc10d"
#: How long an abort waits for the generation's ops to drain after its sockets are cut.
#: They fail within milliseconds. One that is still running after this is abandoned (see
#: ``Generation._drain``): Gloo leaves a send waiting out its timeout when the peer had
#: closed the connection before this process sent (the frozen side of a SIGSTOP, and a
#: survivor of a SIGKILL now and then). The bound is a SIGKILL stall's largest term when
#: that happens (was 1 s: stalls of 1.2-1.3 s in the chaos runs), and still tens of times
#: the few milliseconds a cut op takes to fail on a loaded 2-core machine.
ABORT_DRAIN_TIMEOUT = timedelta(seconds=0.25)
#: How long an abort waits for its note (why it aborted) to reach the store before it cuts the
#: connections anyway (``Generation._announce_abort``): milliseconds normally; longer means
#: another thread holds the shared store connection.
ABORT_NOTE_WAIT_S = 0.25
#: How a flight-recorder entry names a failure the backend reported after the fact.
_ENTRY_FAILURE = {FailureKind.TIMEOUT: "timeout", FailureKind.PEER_CLOSED: "peer failure"}


def is_communication_failure(exc: BaseException, comm: Communicator) -> bool:
    """Whether a backend error is a failed connection or a timeout (vs. rejected arguments)."""
    return comm.classify(exc) in (FailureKind.TIMEOUT, FailureKind.PEER_CLOSED)


def _label(uuid: Optional[int]) -> str:
    return "the initial configuration" if uuid is None else f"generation {uuid}"


class Generation:
    """One connected configuration: ``uuid``, ``rank``/``size`` in it, its backend."""

    def __init__(
        self,
        uuid: Optional[int],
        rank: int,
        size: int,
        handles: tuple[str, ...],
        global_ranks: tuple[int, ...],
        comm: Communicator,
        store: dist.Store,
        fire_abort_hooks: Callable[[], None],
    ) -> None:
        self.uuid = uuid
        self.rank = rank
        self.size = size
        self.handles = handles
        self.global_ranks = global_ranks
        self.comm = comm
        self.backend = comm.backend
        self.store = store
        self.label = _label(uuid)
        self.collective_seq = 0
        self.p2p_seq = 0
        self.aborted = False
        self.abort_reason = ""
        self.error_type: Any = ErrorType.SUCCESS
        self.failed_peer: Optional[int] = None
        #: What an op of this generation raises once it was aborted, and what to do then.
        self.aborted_error_type: type[ProcessGroupAborted] = ProcessGroupAborted
        self.aborted_hint = "Reconfigure the group with a fresh uuid to continue."
        self._fire_abort_hooks = fire_abort_hooks
        #: Told of the first failure of this generation (set by the owning group).
        self.on_error: Optional[Callable[[CollectiveError], None]] = None
        #: (pg name, desc) of this generation in flight-recorder dumps, set by the recorder.
        self.fr_info: Optional[tuple[str, str]] = None
        #: (backend work, flight-recorder entry, ftc10d Work or None) of the ops in flight.
        self._pending: deque[tuple[Any, Optional[OpRecord], Any]] = deque()
        self._lock = threading.Lock()
        self._aborting_thread: Optional[int] = None
        self._abort_done = threading.Event()

    # ------------------------------------------------------------------ data path

    def track(self, inner: Any, entry: Optional[OpRecord] = None, work: Any = None) -> None:
        """Remember a backend work until it completes, so abort can drain it (and abandon
        ``work``, the ftc10d Work over it, if the backend never finishes it); a completion
        noticed here is reported to the op's record."""
        pending = self._pending
        # Completed works hold their tensors: let them go as soon as possible.
        while pending and backend_done(pending[0][0], pending[0][2]):
            _settle(*pending.popleft()[:2], self.comm)
        pending.append((inner, entry, work))
        if len(pending) > 64:  # a long-running op at the front blocks front pruning
            keep: deque[tuple[Any, Optional[OpRecord], Any]] = deque()
            for item in pending:
                if backend_done(item[0], item[2]):
                    _settle(*item[:2], self.comm)
                else:
                    keep.append(item)
            self._pending = keep
        if self.aborted and self._aborting_thread != threading.get_ident():
            # The abort began between this op's issue-time check and here: its drain may have
            # run already and never seen the op, which Gloo then runs on cut connections until
            # its timeout while its wait() hangs (reliability.md finding 28). Drain it now.
            self._abort_done.wait()
            self._drain(self._running())

    def has_pending(self) -> bool:
        """Whether any op of this generation is still running."""
        return any(not backend_done(inner, work) for inner, _, work in list(self._pending))

    def poll(self) -> None:
        """Report completions of pending works to their records (for a dump)."""
        for inner, entry, work in list(self._pending):
            if entry is not None and not entry.settled and backend_done(inner, work):
                _settle(inner, entry, self.comm)

    def wait_aborted(self) -> None:
        """Return once this generation's abort (started by its first failure, maybe on
        another thread) is complete; at once when called from the aborting thread (a hook)."""
        if self._aborting_thread != threading.get_ident():
            self._abort_done.wait()

    def aborted_error(self, op: str, seq: int) -> ProcessGroupAborted:
        return self.aborted_error_type(
            f"{op} #{seq} of {self.label} (rank {self.rank} of {self.size}) was aborted: {self.abort_reason}. "
            + self.aborted_hint,
            op=op,
            seq=seq,
            uuid=self.uuid,
            peer=self.failed_peer,
            error_type=self.error_type,
        )

    def on_failure(self, op: str, seq: int, exc: BaseException, *, abort_inline: bool) -> CollectiveError:
        """Type the backend's error and abort the generation if this is its first failure."""
        if self.aborted or self._aborting_thread is not None:
            return self.aborted_error(op, seq)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"{op} #{seq} of {self.label} (rank {self.rank} of {self.size})"
        kind = self.comm.classify(exc)
        if kind == FailureKind.TIMEOUT:
            err: CollectiveError = CollectiveTimeoutError(
                f"{where} timed out: {text}. The configuration was aborted; a peer is probably frozen, "
                "partitioned or slow. Reconfigure with a fresh uuid to continue.",
                op=op, seq=seq, uuid=self.uuid, error_type=ErrorType.TIMEOUT,
            )
        elif kind == FailureKind.PEER_CLOSED:
            peer, why, closer_aborted = self._root_cause(text)
            who = f"peer rank {peer}" if peer is not None else "a peer"
            if closer_aborted:
                # A survivor aborted first and cut its connections: that is an abort, not a death.
                err = ProcessGroupAborted(
                    f"{where} was aborted: {why}. Reconfigure the group with a fresh uuid to continue.",
                    op=op, seq=seq, uuid=self.uuid, peer=peer, error_type=ErrorType.REMOTE_ERROR,
                )
            else:
                err = PeerFailureError(
                    f"{where} failed: {who} {why} ({text}). The configuration was aborted; "
                    "reconfigure without the failed member to continue.",
                    op=op, seq=seq, uuid=self.uuid, peer=peer, error_type=ErrorType.REMOTE_ERROR,
                )
        else:
            err = CommunicationError(
                f"{where} failed: {text}. The configuration was aborted.",
                op=op, seq=seq, uuid=self.uuid, error_type=ErrorType.COMM_ERROR,
            )
        reason = f"{op} #{seq} failed: {type(err).__name__}{'' if err.peer is None else f' (peer rank {err.peer})'}"
        if isinstance(err, ProcessGroupAborted):
            reason = str(err).split(" was aborted: ", 1)[-1].split(". Reconfigure")[0]
        if self.on_error is not None:
            try:
                self.on_error(err)
            except Exception:
                logger.exception("error listener raised; ignored")
        if abort_inline:
            self.abort(err.error_type, reason, err.peer)
        else:
            threading.Thread(
                target=self.abort, args=(err.error_type, reason, err.peer), name="ftc10d-abort", daemon=True
            ).start()
        return err

    def _root_cause(self, text: str) -> tuple[Optional[int], str, bool]:
        """Name the member that really failed, not the survivor that aborted first.

        When a peer dies, its neighbours abort and cut their connections, so the
        others see *those* neighbours close. Each aborting member records why
        under ``aborted/<rank>`` before cutting, and the first member that names
        a dead peer records it under ``failed``; the rest read both.

        Returns (failed peer or None, explanation, whether the closer had aborted).
        """
        try:
            if self.store.check(["failed"]):  # a member already named the dead peer
                return int(self.store.get("failed")), "failed", False
            closer = self.comm.peer_of(text)
            if closer is not None and self.store.check([f"aborted/{closer}"]):
                reason = self.store.get(f"aborted/{closer}").decode()
                return None, f"peer rank {closer} aborted the configuration ({reason})", True
            if closer is None:
                return None, "closed its connection", False
            blamed = int(self.store.compare_set("failed", "", str(closer)).decode())
            why = "closed its connection: it died or was killed" if blamed == closer else "failed"
            return blamed, why, False
        except Exception:  # the store may be unreachable too: naming the peer is best effort
            logger.debug("could not determine the failed peer", exc_info=True)
            return None, "closed its connection", False

    # ------------------------------------------------------------------- abort

    def abort(self, error_type: Any, reason: str, failed_peer: Optional[int] = None, *, hooks: bool = True) -> bool:
        """Abort once: hooks, then cut the sockets, then drain every pending op.

        Returns True for the call that did the abort. A concurrent caller waits
        until the abort is complete; a hook that aborts again returns at once.
        """
        me = threading.get_ident()
        with self._lock:
            if self._aborting_thread is not None or self.aborted:
                first = False
            else:
                first = True
                self._aborting_thread = me
                self.abort_reason = reason
                self.error_type = error_type
                self.failed_peer = failed_peer
        if not first:
            if self._aborting_thread != me:
                self._abort_done.wait()
            return False
        t0 = time.perf_counter()
        self._announce_abort(reason)
        try:
            if hooks:
                self._fire_abort_hooks()
        finally:
            self.aborted = True
            # An adapter whose cut does not fail the pending ops (NCCL): those not completed now
            # are abandoned after the cut, whatever their backend wait says then.
            running = self._running()
            cut = 0
            try:
                cut = self.comm.cut()
            except Exception:  # the drain and the waiters' release must happen whatever this did
                logger.exception("%s: cutting the connections failed", self.label)
            try:
                self._drain(running)
            finally:
                self._abort_done.set()
        logger.info(
            "aborted %s (rank %d of %d): %s; %d connection(s) cut in %.1f ms",
            self.label, self.rank, self.size, reason, cut, (time.perf_counter() - t0) * 1e3,
        )
        return True

    def _announce_abort(self, reason: str) -> None:
        """Write why this rank aborted (``aborted/<rank>``, read by the peers whose connection it
        cuts, to name the cause) before the cut, waiting at most ``ABORT_NOTE_WAIT_S``.

        Written on a helper thread: the group's store connection is shared (every group of a
        process is a prefix of one client), and another thread may hold it in a long call, e.g.
        a sub-group's rendezvous waiting for members that went on to a newer configuration. An
        abort that waited for it would wait out that rendezvous (7.5 s, twice, in an FT-HSDP
        chaos trial), and that rendezvous is only given up when this abort reaches the
        sub-group through the hooks. Late or lost, the note only names a cause less precisely.
        Inline (no thread handoff, which costs a loaded machine ms on the abort's path) while no
        call that can hold the connection for long is in progress (:func:`long_store_call`)."""
        if not long_store_calls():
            try:  # nothing of ftc10d holds the connection for long: the note is written in ~1 ms
                self.store.set(f"aborted/{self.rank}", reason)
            except Exception:
                logger.debug("could not announce the abort", exc_info=True)
            return
        done = threading.Event()

        def note() -> None:
            track_retiring(threading.current_thread())  # the exit waits for it (in the store's C++ client)
            try:
                self.store.set(f"aborted/{self.rank}", reason)
            except Exception:
                logger.debug("could not announce the abort", exc_info=True)
            finally:
                done.set()
                untrack_retiring()

        ABORT_NOTES.submit(note)  # an idle helper: no thread start on the abort's path
        if not done.wait(ABORT_NOTE_WAIT_S):
            logger.info("%s: the store connection is busy (another thread's call); aborting without "
                        "waiting for the abort's note to reach the store", self.label)

    def retire(self) -> None:
        """Drop the (aborted) backend on a background thread.

        Destroying a ``ProcessGroupGloo`` joins its worker threads and closes its sockets:
        a few milliseconds normally, but **up to the op timeout** when the abort abandoned
        an op that Gloo keeps running (its worker thread stays in it until then). So the
        last reference must go on the retire thread, never on the caller's: the thread is
        handed the only one, in a list it empties (a local variable here, outliving a thread
        that had already finished, made every reconfigure after such an abort wait out the
        op timeout: issue 14's 30-s join stall).
        """
        holder = [self.comm.retire()]
        self.backend = None
        if holder[0] is not None:
            thread = threading.Thread(target=release, args=(holder,), name="ftc10d-retire", daemon=True)
            track_retiring(thread)
            thread.start()

    def _running(self) -> set[int]:
        """ids of the backend works of the ops in flight not completed now, on a communicator whose
        cut does not fail them (``Communicator.cut_fails_ops``; per op: a two-channel group's)."""
        return {id(inner) for inner, _, work in list(self._pending)
                if not (self.comm if work is None else work.comm).cut_fails_ops and not backend_done(inner, work)}

    def _drain(self, running: Optional[set[int]] = None) -> None:
        """Wait for the ops in flight, whose connections were just cut, to fail; abandon
        those still running at ``ABORT_DRAIN_TIMEOUT``.

        An op still running then waits in Gloo for something its cut (or already closed)
        connections can never deliver: Gloo does not wake a send queued on a pair whose peer
        had closed it first, and that send waits out the op's whole timeout (the frozen
        member of a SIGSTOP, resumed after the others aborted, is the usual case). With no
        connection left it can move no more data, so it cannot write into a user tensor:
        its Work's waits and futures fail now with ``ProcessGroupAborted`` (the caller
        goes on to reconfigure), and Gloo's thread gives it up at its timeout, unseen."""
        deadline = time.monotonic() + ABORT_DRAIN_TIMEOUT.total_seconds()
        abandoned = 0
        while self._pending:
            inner, entry, work = self._pending.popleft()
            if running is not None and id(inner) in running:
                # ``running``: the ops not completed when an abort that does not fail them began
                # (``Communicator.cut_fails_ops``): whatever their backend says, they failed.
                abandoned += 1
                if entry is not None:
                    entry.fail("aborted")
                if work is not None:
                    work.abandon(self.aborted_error(work.op, work.seq))
                continue
            if backend_done(inner, work):
                # Done: it can write nothing more. And Gloo's send/recv works must not be waited
                # twice: a second wait() blocks until the op's timeout (found by the chaos guards).
                _settle(inner, entry, self.comm)
                continue
            left = deadline - time.monotonic()
            if work is not None and work.helper_waited:
                # Through the Work's one backend wait: a second Gloo wait on a send/recv that
                # completed meanwhile would block until the op's timeout.
                finished = work.p2p_backend_wait().wait(max(left, 0.0))
            else:
                try:
                    inner.wait(backend_timeout(timedelta(seconds=max(left, 0.0))))
                except Exception:
                    pass  # failing is what we expect of them; still running if it timed out
                finished = inner.is_completed()
            if finished:
                if entry is not None and not entry.settled:
                    helper = work is not None and work.helper_waited
                    if (work._p2p_outcome if helper else work_exception(inner)) is None:  # type: ignore[union-attr]
                        entry.complete()
                    else:  # failing is what we expect of them
                        entry.fail("aborted")
                continue
            abandoned += 1
            if entry is not None:
                entry.fail("aborted")
            if work is not None:
                work.abandon(self.aborted_error(work.op, work.seq))
        if abandoned:
            logger.warning("abort of %s: %d op(s) still running in the backend %s after their connections were "
                           "cut; abandoned (their waits and futures fail now; with no connection left they can "
                           "move no more data)", self.label, abandoned, ABORT_DRAIN_TIMEOUT)


def _settle(inner: Any, entry: Optional[OpRecord], comm: Communicator) -> None:
    if entry is None or entry.settled:  # usually wait() got there first: nothing to ask the backend
        return
    exc = work_exception(inner)
    if exc is None:
        entry.complete()
    else:
        entry.fail(_ENTRY_FAILURE.get(comm.classify(exc), "communication error"))


#: Retire threads still dropping a backend; joined at interpreter exit (``_join_retiring``).
_retiring: set[threading.Thread] = set()
_retiring_lock = threading.Lock()
#: How long the interpreter's exit waits for them.
RETIRE_AT_EXIT_S = 10.0


#: Store calls in progress in this process that can hold a store connection for long (a
#: rendezvous waiting for its members, a backend's connect): see ``Generation._announce_abort``.
_long_calls = 0
_long_calls_lock = threading.Lock()


@contextmanager
def long_store_call() -> Iterator[None]:
    """Marks a store call that may hold the process's shared store connection for seconds."""
    global _long_calls
    with _long_calls_lock:
        _long_calls += 1
    try:
        yield
    finally:
        with _long_calls_lock:
            _long_calls -= 1


def long_store_calls() -> int:
    """How many :func:`long_store_call` calls are in progress now."""
    return _long_calls


def track_retiring(thread: threading.Thread) -> None:
    """Make the interpreter's exit wait for ``thread`` (it drops a backend: see ``_join_retiring``)."""
    with _retiring_lock:
        _retiring.add(thread)


def untrack_retiring() -> None:
    """The calling thread is done with what it was dropping."""
    with _retiring_lock:
        _retiring.discard(threading.current_thread())


def release(holder: list[Any]) -> None:
    """Drop the retired backend: ``holder`` holds its last reference (see ``Generation.retire``)."""
    holder.clear()
    untrack_retiring()


def _join_retiring(timeout: float = RETIRE_AT_EXIT_S) -> None:
    """At interpreter exit, wait for the retire threads (registered with ``atexit``).

    Why: a retire thread is a daemon thread inside ``ProcessGroupGloo``'s C++ destructor (it
    joins Gloo's threads and closes sockets). If the interpreter finalizes meanwhile, the
    thread is killed as it comes back into Python (``pthread_exit``), whose forced unwind
    through a ``noexcept`` C++ frame calls ``std::terminate``: the process aborted ("terminate
    called without an active exception", SIGABRT) after a script's clean
    ``destroy_process_group(); sys.exit(0)``. A backend destroyed after a clean shutdown takes
    milliseconds; one whose op an abort abandoned can take up to that op's timeout, so the
    wait is bounded."""
    deadline = time.monotonic() + timeout
    with _retiring_lock:
        threads = list(_retiring)
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    late = [t for t in threads if t.is_alive()]
    if late:
        logger.warning("exit: %d retired process group backend(s) still closing after %.0f s (an op an abort "
                       "abandoned is still running in Gloo); the process may abort as it exits", len(late), timeout)


atexit.register(_join_retiring)

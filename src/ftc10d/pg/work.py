"""The ``Work`` every ftc10d op returns: the backend's work, with typed failures.

``wait()`` blocks in the backend's own (GIL-free) wait. It needs no watchdog to
be woken by an abort: aborting a configuration cuts its sockets, which makes
every op of that configuration fail at once, and the failure is translated
here into :class:`~ftc10d.types.ProcessGroupAborted`. A first failure of any
other kind (timeout, peer gone) aborts the configuration, so that the other
pending ops fail just as fast instead of each waiting out its own timeout.

The one op the cut does not wake (a Gloo send queued on a connection the peer had
already closed) is abandoned by the abort (``Generation._drain``): its future, and a
``wait()`` that is waiting on it, fail then instead of at the backend's timeout. That
is why a collective's ``wait()`` waits in the backend in 50-ms slices (free: the op
usually completes within the first), and a send/recv's ``wait()`` waits on an event
while a helper thread does the backend's one wait (Gloo gives them no future).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from ftc10d._compat import work_exception
from ftc10d.pg.helpers import BACKEND_WAITS
from ftc10d.pg.observer import error_kind
from ftc10d.types import CollectiveError

if TYPE_CHECKING:
    from ftc10d.pg.backend import Communicator
    from ftc10d.pg.generation import Generation
    from ftc10d.pg.observer import OpRecord
    from ftc10d.pg.profiling import OpSpan


#: How often a collective's untimed wait() looks whether an abort abandoned its op.
_WAIT_SLICE = timedelta(seconds=0.05)


def backend_done(inner: Any, work: Optional["Work"]) -> bool:
    """Whether the backend's ``inner`` work (under ftc10d's ``work``) can write nothing more."""
    if inner.is_completed():
        return True
    if work is None or not work.wait_completes:
        return False
    finished = work._p2p_finished
    return finished is not None and finished.is_set()


def backend_timeout(timeout: timedelta) -> timedelta:
    """``timeout`` for a c10d wait: at least 1 ms, because c10d reads one that rounds to
    0 ms as "no timeout" and would wait for ever."""
    return max(timeout, timedelta(milliseconds=1))


class Work(dist.Work):
    """A pending op of one configuration (generation)."""

    #: Its ``<backend>:<op>`` profiler span, while a profiler records (:mod:`ftc10d.pg.profiling`).
    _span: Optional["OpSpan"] = None

    def __init__(
        self, gen: "Generation", op: str, seq: int, inner: Any, result: Any, entry: Optional["OpRecord"] = None,
        comm: Optional["Communicator"] = None,
    ) -> None:
        super().__init__()
        self._entry = entry
        self._gen = gen
        self._op = op
        self._seq = seq
        self._inner = inner
        self._result = result
        self._error: Optional[CollectiveError] = None
        self._lock = threading.Lock()
        #: The future handed out (one per Work), completed by the backend's or by abandon().
        self._fut: Optional[torch.futures.Future] = None
        self._gate: Optional[torch.futures.Future] = None
        self._fut_set = False
        #: send/recv: the one backend wait (p2p_backend_wait), its outcome, and the event
        #: that releases the caller's wait() (set by that wait's end or by abandon()).
        self._p2p_finished: Optional[threading.Event] = None
        self._p2p_outcome: Optional[BaseException] = None
        #: Called once that backend wait returned (a reduce-scatter's future, see get_future).
        self._p2p_done: Optional[Any] = None
        self._wake: Optional[threading.Event] = None
        #: The communicator the op runs on (a two-channel group's channel, ftc10d.pg.channels).
        self.comm = comm = gen.comm if comm is None else comm
        #: The adapter's capabilities for this op (``Communicator.helper_wait_ops``, ``wait_completes_ops``).
        self.helper_waited = op in comm.helper_wait_ops
        self.wait_completes = op in comm.wait_completes_ops

    # -- introspection used by hooks and the flight recorder
    @property
    def op(self) -> str:
        return self._op

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def uuid(self) -> Optional[int]:
        return self._gen.uuid

    def _poll(self, timeout: Optional[timedelta]) -> None:
        """Wait on the CPU until the backend completed the op (``Communicator.poll_wait``: its
        own wait returns before that), in slices growing to 1 ms; an abort that abandons the op
        ends it with ``ProcessGroupAborted``. Then the backend's wait (its error, stream order)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        pause = 1e-5
        while not self._inner.is_completed():
            if self._error is not None:  # abandoned
                self._gen.wait_aborted()
                raise self._error from None
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"Operation timed out after {timeout} (Work.wait timeout)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if self._error is not None:
            raise self._error from None
        self._inner.wait()

    def _translate(self, exc: BaseException, *, abort_inline: bool) -> CollectiveError:
        if self._error is None:
            self._error = self._gen.on_failure(self._op, self._seq, exc, abort_inline=abort_inline)
            if self._entry is not None:
                self._entry.fail(error_kind(self._error))
        return self._error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._error is not None:
            raise self._error
        untimed = timeout is None or timeout == timedelta(0)
        try:
            if untimed and self.helper_waited:
                self._wait_p2p()  # the one backend wait: again after completion, it returns at once
            elif self.comm.poll_wait:
                self._poll(None if untimed else timeout)
            elif untimed:
                # In slices, so that an abort that abandons the op releases us within one.
                # A slice that ends leaves the backend's work untouched (no side effect on a
                # collective's work; send/recv are waited once, above).
                while True:
                    try:
                        self._inner.wait(_WAIT_SLICE)
                        break
                    except Exception:
                        if self._inner.is_completed():
                            # Failed, or it completed between the slice's timeout and this
                            # check: its own outcome, then (a completed work's wait returns
                            # at once or raises the op's error, not the slice's timeout).
                            self._inner.wait()
                            break
                        if self._error is not None:  # abandoned
                            self._gen.wait_aborted()
                            raise self._error from None
            elif self.helper_waited:
                assert timeout is not None
                if not self.p2p_backend_wait().wait(timeout.total_seconds()):
                    raise RuntimeError(f"Operation timed out after {timeout} (Work.wait timeout)")
                if self._p2p_outcome is not None:
                    raise self._p2p_outcome
            else:
                self._inner.wait(backend_timeout(timeout))
        except CollectiveError:
            raise
        except Exception as exc:  # the backend raises RuntimeError/DistBackendError
            raise self._translate(exc, abort_inline=True) from exc
        if self._entry is not None:
            self._entry.complete()
        if self._span is not None:  # profiled: in the profile once wait() returned (pg/profiling.py)
            self._span.wait_closed()
        return True

    def p2p_backend_wait(self) -> threading.Event:
        """Start the one backend wait of this send/recv (or Gloo reduce-scatter,
        ``Communicator.wait_completes_ops``), on a helper thread, unless it started; the event is set once
        it returned (outcome in ``_p2p_outcome``).

        Gloo gives send/recv no future, a timed wait that ends marks their work failed
        (so they cannot be waited in slices like collectives), and a second wait after
        completion blocks until the op's timeout: the caller's ``wait()`` and an abort's
        drain both go through this one wait. A helper left in a Gloo wait that its cut
        connections never end (see the module docstring) ends at the op's timeout."""
        with self._lock:
            if self._p2p_finished is not None:
                return self._p2p_finished
            finished = self._p2p_finished = threading.Event()

        def run() -> None:
            try:
                self._inner.wait()
            except BaseException as exc:  # handed to whoever waits
                self._p2p_outcome = exc
            finally:
                finished.set()
                wake = self._wake
                if wake is not None:
                    wake.set()
                done = self._p2p_done
                if done is not None:
                    done()

        BACKEND_WAITS.submit(run)  # an idle helper thread, or a new one (ftc10d.pg.helpers)
        return finished

    def _wait_p2p(self) -> None:
        """The caller's side of :meth:`p2p_backend_wait`: released by its end, or by an abandon."""
        wake = threading.Event()
        with self._lock:
            self._wake = wake
            abandoned = self._fut_set
        finished = self.p2p_backend_wait()
        if not abandoned and not finished.is_set():
            wake.wait()
        if not finished.is_set():  # abandoned by the abort: Gloo still waits, we do not
            assert self._error is not None
            self._gen.wait_aborted()
            raise self._error
        if self._p2p_outcome is not None:
            raise self._p2p_outcome

    def get_future(self) -> torch.futures.Future:
        """A future completed with the op's outputs, or with the typed error (also when an
        abort abandons the op).

        The backend's callback runs on a backend thread, where a blocking abort could
        deadlock (it waits for that very thread), so the abort it triggers runs on a
        thread of its own. The error reaches the future by being raised in a ``then()``
        callback, never by ``set_exception``: C++ waiters (DDP's reducer) rethrow it on
        threads without the GIL, which only torch's conversion in ``then()`` makes safe.
        """
        with self._lock:
            fut = self._fut
            if fut is not None:
                return fut
            gate: torch.futures.Future = torch.futures.Future()
            fut = self._fut = gate.then(self._deliver)
            self._gate = gate
            abandoned = self._fut_set  # abandon() came first
        if abandoned:
            gate.set_result(self._error)
            return fut
        if self.wait_completes:  # Gloo gives none: completed by the one backend wait
            self._p2p_done = self._relay_helper
            if self.p2p_backend_wait().is_set():
                self._relay_helper()
            return fut
        try:
            inner_fut = self._inner.get_future()
        except RuntimeError:  # this backend work has none
            with self._lock:
                self._fut = self._gate = None
            raise
        inner_fut.then(self._relay)
        return fut

    def _deliver(self, gate: torch.futures.Future) -> Any:
        outcome = gate.value()
        if isinstance(outcome, BaseException):
            raise outcome
        return self._result

    def _relay(self, inner_fut: torch.futures.Future) -> None:
        if self._fut_set:  # abandoned meanwhile: its record already says so
            return
        try:
            inner_fut.value()
        except Exception as exc:
            self._finish(error=self._translate(exc, abort_inline=False))
            return
        if self._entry is not None:
            self._entry.complete()
        self._finish()

    def _relay_helper(self) -> None:
        """The future of a ``wait_completes_ops`` op, from its helper's backend wait."""
        if self._fut_set:
            return
        outcome = self._p2p_outcome
        if outcome is not None:
            self._finish(error=self._translate(outcome, abort_inline=False))
            return
        if self._entry is not None:
            self._entry.complete()
        self._finish()

    def _finish(self, error: Optional[BaseException] = None) -> None:
        """Open the gate once (the backend and an abandoning abort may race); outside the
        lock: completing it runs the future's callbacks here."""
        with self._lock:
            if self._fut_set:
                return
            self._fut_set = True
            gate = self._gate
        if gate is not None:
            gate.set_result(error)

    def abandon(self, error: CollectiveError) -> None:
        """Fail this op now although the backend still runs it (see the module docstring);
        called by the abort once the op's connections are cut."""
        if self._error is None:
            self._error = error
        self._finish(error=self._error)
        wake = self._wake
        if wake is not None:
            wake.set()

    def is_completed(self) -> bool:
        return self._fut_set or backend_done(self._inner, self)

    def is_success(self) -> bool:
        return self._error is None and bool(self._inner.is_success())

    def exception(self) -> Optional[BaseException]:
        if self._error is not None:
            return self._error
        return work_exception(self._inner)

    def result(self) -> Any:
        return self._result

    def _source_rank(self) -> int:
        """The sender of a completed ``recv_anysource`` (torch's ``dist.recv(t)`` without ``src``
        reads it under this name); ``source_rank()`` is the same."""
        inner = self._inner
        return int(inner._source_rank() if hasattr(inner, "_source_rank") else inner.source_rank())

    source_rank = _source_rank

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        return f"ftc10d.Work({self._op} #{self._seq} of {self._gen.label})"


class CompletedWork(dist.Work):
    """A work that is already done (reconfigure, local no-ops)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result
        self._fut: Optional[torch.futures.Future] = None
        self._lock = threading.Lock()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
                self._fut.set_result(self._result)
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> Any:
        return self._result


class MultiWork(dist.Work):
    """Several backend works issued as one op (coalesced ops Gloo lacks natively)."""

    def __init__(self, works: list[dist.Work], result: Any) -> None:
        super().__init__()
        self._works = works
        self._result = result

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        for w in self._works:
            w.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        futs = [w.get_future() for w in self._works]
        result = self._result

        def done(all_done: torch.futures.Future) -> Any:
            for f in all_done.value():
                f.value()
            return result

        return torch.futures.collect_all(futs).then(done)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def result(self) -> Any:
        return self._result


class SwallowedWork(CompletedWork):
    """An op of a group that swallows errors (:meth:`ProcessGroup.swallow_errors`): a
    communication failure is handed to ``report`` and the op completes normally, its
    outputs as they are (meaningless: the caller's step must not commit).

    Why: a caller that cannot be interrupted half-way without corrupting its own state
    (FSDP2's backward: an exception out of its reduce-scatter leaves its per-module
    state machine half-way, and its next backward issues no reduce-scatter at all) gets
    ops that always complete; the step is then discarded by whoever received the report.
    ``wait()`` with a timeout still raises a plain timeout: that is not a failure of the op.
    """

    def __init__(self, work: dist.Work, report: Callable[[BaseException], None], result: Any) -> None:
        super().__init__(result)
        self._work = work
        self._report = report
        self._swallowed: Optional[BaseException] = None

    def _swallow(self, exc: BaseException) -> Any:
        if self._swallowed is None:
            self._swallowed = exc
            self._report(exc)
        return self._result

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        try:
            self._work.wait(timeout)
        except CollectiveError as exc:
            self._swallow(exc)
        return True

    def get_future(self) -> torch.futures.Future:
        def done(fut: torch.futures.Future) -> Any:
            try:
                return fut.value()
            except Exception as exc:  # torch's then() turns our typed errors into RuntimeError
                return self._swallow(exc)

        return self._work.get_future().then(done)

    def is_completed(self) -> bool:
        return self._swallowed is not None or bool(self._work.is_completed())

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        return f"ftc10d.SwallowedWork({self._work!r})"

"""Our ops in torch's profiler, named as torch names a backend's ops.

A Gloo group's collective shows up in ``torch.profiler`` / ``torch.autograd.profiler`` twice:
the dispatcher's span (``c10d::allreduce_``, the caller's thread, while the op is issued) and
the backend's async span (``gloo:all_reduce``, from issue to completion, with the input
shapes), which c10d's ``Work`` opens and the backend's thread closes. An ftc10d group's ops
reach Python without the dispatcher, so neither would exist under our name (only the inner
Gloo group's ``gloo:all_reduce``): a trace would not say which group ran what, and torch's
own profiler checks (``<backend>:<op>``, async, one per op, input shapes) would find nothing.

So while a profiler records (one C call to ask, nothing else otherwise), each op opens

- the dispatcher's span ``c10d::<op>`` around the issue, and
- ``ftc10d:<op>`` (torch's titles: ``all_reduce``, ``recvAnySource`` ...) with the inputs'
  shapes, closed by one closer thread once the op completed. An event closed on another
  thread than the one that opened it is what torch's profiler calls async, as Gloo's are.
  ``Work.wait()`` returns once that span is closed, so an op waited on inside a profiled
  region is in the profile.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Iterator, Optional

import torch

_enabled = torch.autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
# A record with tensor arguments (their shapes recorded), ended where we like: torch.profiler's own
# ``record_function``-with-args (torch.autograd._record_function_with_args_enter/exit).
_enter = torch._C._autograd._record_function_with_args_enter
_exit = torch._C._autograd._record_function_with_args_exit

#: op -> (the dispatcher op's name, the backend title torch gives it); Gloo's titles where it has one.
_NAMES: dict[str, tuple[str, str]] = {
    "all_reduce": ("c10d::allreduce_", "all_reduce"),
    "all_reduce_coalesced": ("c10d::allreduce_coalesced_", "all_reduce_coalesced"),
    "broadcast": ("c10d::broadcast_", "broadcast"),
    "reduce": ("c10d::reduce_", "reduce"),
    "all_gather": ("c10d::allgather_", "all_gather"),
    "all_gather_coalesced": ("c10d::allgather_coalesced_", "all_gather_coalesced"),
    "all_gather_into_tensor": ("c10d::_allgather_base_", "all_gather_into_tensor"),
    "gather": ("c10d::gather_", "gather"),
    "gather_into_tensor": ("c10d::gather_", "gather"),
    "scatter": ("c10d::scatter_", "scatter"),
    "reduce_scatter": ("c10d::reduce_scatter_", "reduce_scatter"),
    "reduce_scatter_tensor": ("c10d::_reduce_scatter_base_", "reduce_scatter_tensor"),
    "all_to_all": ("c10d::alltoall_", "all_to_all"),
    "all_to_all_single": ("c10d::alltoall_base_", "all_to_all"),
    "barrier": ("c10d::barrier", "barrier"),
    "send": ("c10d::send", "send"),
    "recv": ("c10d::recv_", "recv"),
    "recv_anysource": ("c10d::recv_any_source_", "recvAnySource"),
}


def enabled() -> bool:
    """Whether a profiler records on this thread (the only cost of this module otherwise)."""
    return bool(_enabled())


def dispatcher_span(op: str) -> Any:
    """The ``c10d::<op>`` span to enter around an op's issue."""
    return _RecordFunctionFast(_NAMES.get(op, (f"c10d::{op}", op))[0])


class OpSpan:
    """``<backend>:<op>`` from issue to completion (see the module docstring)."""

    __slots__ = ("_record", "closed", "work", "_done")

    def __init__(self, backend: str, op: str, inputs: list[torch.Tensor]) -> None:
        self._record = _enter(f"{backend}:{_NAMES.get(op, ('', op))[1]}", *inputs)
        self.closed = threading.Event()
        self.work: Any = None
        # The profiler's state is thread-local: a torch future's callback runs with the state
        # of the thread that attached it (c10's TLS propagation), here this one's.
        self._done: torch.futures.Future = torch.futures.Future()
        self._done.then(self._exit)

    def _exit(self, _: Any) -> None:
        _exit(self._record)
        self.closed.set()

    def close(self) -> None:
        """End the span (on the calling thread, with the opening thread's profiler state)."""
        if not self._done.done():
            self._done.set_result(None)

    def wait_closed(self) -> None:
        """Called by ``Work.wait()`` once the op completed: the closer is at most a poll away."""
        self.closed.wait(timeout=5.0)


    def follow(self, work: Any) -> None:
        """Close this span once ``work`` (the op's ftc10d Work, or a wrapper of it) completed."""
        inner = getattr(work, "_work", work)  # SwallowedWork wraps the op's Work
        if hasattr(inner, "_span"):
            inner._span = self  # its wait() returns once the span is closed
        track(self, work)


@contextlib.contextmanager
def op_span(backend: str, op: str, inputs: list[torch.Tensor]) -> Iterator[OpSpan]:
    """An :class:`OpSpan` for the op issued inside; closed at once if issuing it raised."""
    span = OpSpan(backend, op, inputs)
    try:
        yield span
    except BaseException:
        span.close()
        raise


class _Closer:
    """One thread that closes the spans of completed ops (only ever started by a profiled op)."""

    def __init__(self) -> None:
        self._spans: collections.deque[OpSpan] = collections.deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def add(self, span: OpSpan) -> None:
        with self._cv:
            self._spans.append(span)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ftc10d-profiler", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        pause = 1e-4
        while True:
            with self._cv:
                while not self._spans:
                    self._cv.wait()
                spans = list(self._spans)
            done = [s for s in spans if s.work is not None and s.work.is_completed()]
            if done:
                with self._cv:
                    for s in done:
                        self._spans.remove(s)
                for s in done:
                    s.close()
                pause = 1e-4
            else:
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)


_closer = _Closer()


def track(span: OpSpan, work: Any) -> None:
    """Close ``span`` (on the closer thread) once ``work`` completed."""
    span.work = work
    _closer.add(span)

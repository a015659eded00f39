"""Works of window ops, and the per-window executor that runs the asynchronous ones.

Why one FIFO executor per window: torch's windows are stream-ordered. A put
followed by a signal to the same peer must reach it in that order, and a
``wait_signal`` issued before a put delays the put, whether the ops are sync or
async. So every async op goes through one queue, run by one thread, and a
synchronous op runs inline only when that queue is empty (otherwise it is
queued behind the pending ones and waited for).
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ftc10d.types import CollectiveError


class WindowWork(dist.Work):
    """A window op: completed by the executor (async) or at once (sync).

    A synchronous op's work is born completed and never needs an event or a lock;
    those are made only for works that are waited on while pending.
    """

    _lock_all = threading.Lock()  # guards the lazy creation of a work's condition

    def __init__(self, op: str, seq: int, label: str, result: Any,
                 on_wait_timeout: Callable[["WindowWork", timedelta], CollectiveError],
                 done: bool = False) -> None:
        super().__init__()
        self._op = op
        self._seq = seq
        self._label = label
        self._result = result
        self._done = done
        self._error: Optional[BaseException] = None
        self._cv: Optional[threading.Condition] = None
        self._fut: Optional[torch.futures.Future] = None
        self._on_wait_timeout = on_wait_timeout

    @property
    def op(self) -> str:
        return self._op

    @property
    def seq(self) -> int:
        return self._seq

    def _condition(self) -> threading.Condition:
        if self._cv is None:
            with WindowWork._lock_all:
                if self._cv is None:
                    self._cv = threading.Condition(threading.Lock())
        return self._cv

    def _finish(self, error: Optional[BaseException]) -> None:
        with self._condition():
            if self._done:
                return
            self._error = error
            self._done = True
            self._condition().notify_all()
            fut = self._fut
        if fut is not None:
            self._settle(fut)

    def _settle(self, fut: torch.futures.Future) -> None:
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self._done:
            limit = None if timeout is None or timeout <= timedelta(0) else timeout.total_seconds()
            cv = self._condition()
            with cv:
                if not cv.wait_for(lambda: self._done, limit):
                    assert timeout is not None
                    raise self._on_wait_timeout(self, timeout)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        with self._condition():
            if self._fut is None:
                self._fut = torch.futures.Future()
                if self._done:
                    self._settle(self._fut)
            return self._fut

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("ok" if self._error is None else type(self._error).__name__)
        return f"ftc10d.WindowWork({self._op} #{self._seq} on {self._label}, {state})"


Job = Callable[[bool], None]  # called with inline=False on the executor thread


class Executor:
    """One thread, one FIFO. Holds no reference to the window except through queued jobs."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[WindowWork, Job]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def idle(self) -> bool:
        with self._cv:
            return not self._queue and not self._busy

    def submit(self, work: WindowWork, job: Job) -> None:
        with self._cv:
            if self._closed is not None:
                raise self._closed
            self._queue.append((work, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def flush(self) -> None:
        """Wait until every op submitted so far has run."""
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait(0.05)

    def close(self, error: BaseException) -> None:
        """Fail what is queued; the running op (if any) finishes; the thread exits."""
        with self._cv:
            if self._closed is None:
                self._closed = error
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for work, _ in pending:
            work._finish(error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and self._closed is None:
                    self._cv.wait()
                if not self._queue:
                    self._cv.notify_all()
                    return
                work, job = self._queue.popleft()
                self._busy = True
            try:
                job(False)
            except BaseException as exc:  # typed by the job; stored for wait()
                work._finish(exc)
            else:
                work._finish(None)
            finally:
                del job, work  # do not keep the last op's tensors alive while idle
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

"""Reused helper threads for the backend waits that must run off the caller's thread.

Some ops are waited in the backend exactly once, on a helper thread (``Work.p2p_backend_wait``:
Gloo's send/recv and reduce-scatter), so that an abort can release their caller. FSDP2 issues
a reduce-scatter per module per step, and a fresh thread per wait was measured at ~3% of an
FT-HSDP step on a loaded 2-core machine: ``Thread.start`` returns only once the new thread has
run, which waits for a free core. An idle helper takes the next wait at once.

A helper whose wait never returns (an op an abort abandoned, left to the backend's timeout)
simply stays busy: the next wait gets another helper, so one stuck wait never delays others.
At most ``MAX_IDLE`` helpers are kept idle; more end. A forked child starts with none (the
parent's threads do not exist there).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable, Optional

logger = logging.getLogger("ftc10d")

#: Idle helpers kept for the next waits; a helper finishing while this many idle ends.
MAX_IDLE = 8


class _Helper:
    def __init__(self, pool: "HelperPool") -> None:
        self.jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._pool = pool

    def run(self, first: Callable[[], None]) -> None:
        job: Optional[Callable[[], None]] = first
        while job is not None:
            try:
                job()
            except Exception:  # a job's own callback failed: log it, keep the helper
                logger.exception("ftc10d: a backend-wait helper's job raised")
            job = None  # hold no reference (the op's Work, its tensors) while idle
            if not self._pool.park(self):
                return
            job = self.jobs.get()


class HelperPool:
    """Runs each submitted function on an idle helper thread, or a new one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle: list[_Helper] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            helper = self._idle.pop() if self._idle else None
        if helper is not None:
            helper.jobs.put(fn)
            return
        helper = _Helper(self)
        threading.Thread(target=helper.run, args=(fn,), name=self._name, daemon=True).start()

    def park(self, helper: _Helper) -> bool:
        """Called by a helper whose job returned: True if it stays, idle, for the next one."""
        with self._lock:
            if len(self._idle) >= MAX_IDLE:
                return False
            self._idle.append(helper)
            return True

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _after_fork(self) -> None:
        self._idle = []
        self._lock = threading.Lock()


#: The backend waits of every ftc10d group of this process.
BACKEND_WAITS = HelperPool("ftc10d-p2p-wait")
#: Writes an abort's note to the store off the aborting thread (``Generation._announce_abort``).
ABORT_NOTES = HelperPool("ftc10d-abort-note")
os.register_at_fork(after_in_child=BACKEND_WAITS._after_fork)
os.register_at_fork(after_in_child=ABORT_NOTES._after_fork)

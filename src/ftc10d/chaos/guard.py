"""Guard buffers: invariant 2 (no write after abort) checked inside the chaos job, under real faults.

Each step the job keeps a few small ops in flight on the Manager's group whose outputs
are *guard* tensors nobody else uses: a receive from the previous rank of the ring
(issued before the forward pass, matched by the peer's send after its backward pass, so
it is pending through nearly the whole step) and an all-reduce (issued before the forward
pass). Both are waited after the backward pass. When a fault aborts the configuration:

- the abort hook marks every guard op not completed at that moment *pending*;
- a wait that raised is followed by making sure the abort has *returned* (``pg.abort()``
  on the same configuration waits for an abort in progress; a later configuration means
  ``reconfigure`` already returned from aborting the old one); then the op must be
  completed and the guard tensor is snapshotted;
- a pending op whose wait returned instead of raising must hold the complete result (its
  data all arrived before the connections were cut, a benign race of the completion with
  the cut, counted as ``completed_at_cut``); a torn result reported as a success is a
  violation;
- every snapshot is compared with its tensor again after the next reconfigure, a few steps
  later, and at exit: a difference is a write by an op of the aborted generation after
  its abort returned.

Each of these emits an event (``guard_abort``, ``guard_check``, ``guard_violation``) that
:func:`ftc10d.chaos.checks.check_guards` and :func:`~ftc10d.chaos.checks.coverage` read.
The guard ops touch no model, optimizer or gradient tensor: the training result (the
fingerprints) is the same with them. Cost: two messages of 16 floats per step.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ftc10d.types import CollectiveError

logger = logging.getLogger("ftc10d")

#: Elements per guard tensor: small (the ops are probes, not load).
GUARD_N = 16
#: Tag of the guard ring's send/recv (apart from the state transfer's tags).
GUARD_TAG = 0x6A4D0
#: Abort hook id of the guards (apart from the flight recorder's and the windows').
ABORT_HOOK_ID = 0x6A4D
#: Compare snapshots again this many steps after they were taken (and at every reconfigure and at exit).
RECHECK_AFTER_STEPS = 3
#: Written into a receive buffer before the op: any later change is a write by the op.
SENTINEL = -1.0

Emit = Callable[..., None]


@dataclass
class GuardOp:
    """One guard op in flight: its work, its output tensor, the complete result it must hold
    if it succeeds, and the configuration it ran in."""

    kind: str
    work: Any
    tensor: torch.Tensor
    expected: float
    uuid: Optional[int]
    step: int
    pending_at_abort: bool = False


@dataclass
class Snapshot:
    """A guard tensor as it was right after the abort of its configuration returned."""

    op: GuardOp
    value: torch.Tensor
    taken_at_step: int
    rechecked: bool = False


class Guards:
    """The guard ops of one chaos worker (see the module docstring). ``emit(kind, **info)``
    writes an event; ``pg`` is the Manager's group. Not thread-safe except for the abort
    hook, which only marks ops."""

    def __init__(self, pg: Any, emit: Emit) -> None:
        self.pg = pg
        self.emit = emit
        self.inflight: list[GuardOp] = []
        self.snapshots: list[Snapshot] = []
        self._sends: list[Any] = []
        self._lock = threading.Lock()
        #: True while a guard send is being issued: fault-injection pre-hooks leave it alone.
        self.issuing = False
        pg.register_abort_hook(ABORT_HOOK_ID, self._on_abort)

    def _on_abort(self) -> None:
        """Runs at the start of every abort of the group, on the aborting thread."""
        with self._lock:
            for op in self.inflight:
                if not op.work.is_completed():
                    op.pending_at_abort = True

    # ------------------------------------------------------------------ per step

    def issue(self, step: int) -> None:
        """Before the forward pass: the ring receive and the all-reduce."""
        size, rank = self.pg.size(), self.pg.rank()
        ops: list[GuardOp] = []
        try:
            if size > 1:
                buf = torch.full((GUARD_N,), SENTINEL)
                ops.append(GuardOp("recv", self.pg.recv([buf], (rank - 1) % size, GUARD_TAG), buf, float(step),
                                   self.pg.uuid, step))
            red = torch.ones(GUARD_N)
            ops.append(GuardOp("all_reduce", self.pg.allreduce([red]), red, float(size), self.pg.uuid, step))
        except CollectiveError:
            pass  # the configuration is aborted already: no op of it is in flight, nothing to guard
        finally:
            with self._lock:
                self.inflight.extend(ops)

    def send(self, step: int) -> None:
        """After the backward pass: the ring send that completes the next rank's receive."""
        size = self.pg.size()
        if size < 2:
            return
        self.issuing = True
        try:
            self._sends.append(self.pg.send([torch.full((GUARD_N,), float(step))], (self.pg.rank() + 1) % size,
                                            GUARD_TAG))
        except CollectiveError:
            pass
        finally:
            self.issuing = False

    def settle(self, step: int, on_failure: Callable[[BaseException], Any]) -> None:
        """After the backward pass: wait every guard op, snapshot those of an aborted
        configuration once its abort returned, and recheck older snapshots when due."""
        for work in self._sends:
            try:
                work.wait()
            except CollectiveError:
                pass  # a send's buffer is only read: nothing to guard
        self._sends = []
        with self._lock:  # they stay in flight (seen by the abort hook) until they were waited
            ops = list(self.inflight)
        taken: list[Snapshot] = []
        raised = completed_at_cut = running = 0
        for op in ops:
            try:
                op.work.wait()
            except CollectiveError as exc:
                on_failure(exc)
                raised += op.pending_at_abort
                self._abort_returned(op)
                if not op.work.is_completed():
                    running += 1
                    self._violation(op, "its op was still running after the abort of its configuration returned")
                taken.append(Snapshot(op, op.tensor.clone(), step))
                continue
            if op.pending_at_abort:
                if torch.all(op.tensor == op.expected):
                    completed_at_cut += 1
                else:
                    self._violation(op, f"wait() returned although the op was pending when its configuration was "
                                        f"aborted, and the tensor holds {op.tensor.tolist()} (expected all "
                                        f"{op.expected:g})")
        with self._lock:
            self.inflight = []
        if taken:
            self.snapshots += taken
            uuids = sorted({str(s.op.uuid) for s in taken})
            self.emit("guard_abort", step=step, uuids=uuids, snapshots=len(taken),
                      pending=sum(o.pending_at_abort for o in ops), raised=raised,
                      completed_at_cut=completed_at_cut, still_running=running)
        elif completed_at_cut:
            self.emit("guard_abort", step=step, uuids=[], snapshots=0, pending=completed_at_cut, raised=0,
                      completed_at_cut=completed_at_cut, still_running=0)
        due = [s for s in self.snapshots if not s.rechecked and step - s.taken_at_step >= RECHECK_AFTER_STEPS]
        if due:
            self.check("steps", due)
            for s in due:
                s.rechecked = True

    def _abort_returned(self, op: GuardOp) -> None:
        """Return only once the abort of ``op``'s configuration has returned: the invariant
        holds from then on. On the same configuration ``pg.abort()`` is that abort (or waits
        for the one in progress); a newer configuration means ``reconfigure()`` returned
        from aborting the old one."""
        if self.pg.uuid == op.uuid:
            self.pg.abort()

    # ------------------------------------------------------------------ checks

    def check(self, when: str, snapshots: Optional[list[Snapshot]] = None) -> None:
        """Compare snapshots with their tensors now; one ``guard_check`` event, and a
        ``guard_violation`` per changed tensor."""
        snaps = self.snapshots if snapshots is None else snapshots
        if not snaps:
            return
        changed = 0
        for s in snaps:
            if not torch.equal(s.value, s.op.tensor):
                changed += 1
                self._violation(s.op, f"its tensor changed after the abort of its configuration returned "
                                      f"(checked {when}): {s.value.tolist()} -> {s.op.tensor.tolist()}")
        self.emit("guard_check", when=when, checked=len(snaps), changed=changed)

    def _violation(self, op: GuardOp, what: str) -> None:
        logger.error("chaos guard: %s of step %d (configuration %s): %s", op.kind, op.step, op.uuid, what)
        self.emit("guard_violation", op=op.kind, step=op.step, uuid=str(op.uuid), error=what)

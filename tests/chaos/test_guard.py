"""The chaos job's guard buffers (invariant 2) on a real 2-rank group: ops pending at an
abort are snapshotted once the abort returned and rechecked; a write after that is reported."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import ftc10d
from ftc10d.chaos import checks
from ftc10d.chaos.guard import Guards
from tests import harness


def _guards_under_abort(rank: int, world: int, port: int) -> list[dict[str, Any]]:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=30))
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(1, handles, group=pg)
    events: list[dict[str, Any]] = []
    guards = Guards(pg, lambda kind, **info: events.append({"kind": kind, "pid": rank, "t": 0.0, **info}))
    if rank == 0:  # rank 1 never takes part: rank 0's guard ops stay pending until the abort
        failures: list[BaseException] = []
        guards.issue(0)
        threading.Timer(0.3, pg.abort).start()
        guards.send(0)
        guards.settle(0, failures.append)
        events.append({"kind": "failures", "pid": rank, "t": 0.0, "n": len(failures)})
        guards.check("exit")
        guards.snapshots[0].op.tensor.fill_(42.0)  # what a late write by an aborted op would do
        guards.check("exit")
    harness.store_barrier(store, "done", rank, world)
    return events


def test_pending_guards_are_snapshotted_after_the_abort_and_a_later_write_is_reported() -> None:
    events = harness.run(_guards_under_abort, 2)[0]
    kinds = [e["kind"] for e in events]
    aborts = [e for e in events if e["kind"] == "guard_abort"]
    assert len(aborts) == 1, kinds
    assert (aborts[0]["snapshots"], aborts[0]["pending"], aborts[0]["raised"], aborts[0]["still_running"]) == (
        2, 2, 2, 0), aborts
    assert [e["n"] for e in events if e["kind"] == "failures"] == [2]
    check_events = [e for e in events if e["kind"] == "guard_check"]
    assert [(e["checked"], e["changed"]) for e in check_events] == [(2, 0), (2, 1)]
    problems = checks.check_guards(events)
    assert len(problems) == 1 and "changed after the abort" in problems[0], problems
    assert checks.coverage(events)["guard_checks"] == 4

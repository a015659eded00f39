"""``ProcessGroup.swallow_errors``: a peer SIGKILLed, the swallowing rank's ops all
complete (wait() and the future), every failure is reported, bad arguments still raise;
a rank without it gets the typed error as usual (same job, same fault)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ftc10d
from tests import harness

N = 1 << 14


def _worker(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=30))
    reports: list[BaseException] = []
    if rank == 0:
        pg.swallow_errors(reports.append)
    t = torch.full((N,), float(rank + 1))
    dist.all_reduce(t, group=pg)  # a healthy op: its true result, nothing reported
    out: dict = {"healthy": float(t[0]), "reports_before": len(reports)}
    try:
        dist.all_to_all_single(torch.empty(4), torch.empty(4), [1, 1, 1], [9, 9, 9], group=pg)
        out["bad_args"] = "accepted"
    except ftc10d.InvalidOptionError:
        out["bad_args"] = "InvalidOptionError"
    harness.store_barrier(store, "ready", rank, world)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    gathered = torch.full((N * world,), -7.0)
    scattered = torch.full((N,), -9.0)
    t0 = time.monotonic()
    a = dist.all_gather_into_tensor(gathered, torch.ones(N), group=pg, async_op=True)
    b = dist.reduce_scatter_tensor(scattered, torch.ones(N * world), group=pg, async_op=True)
    try:
        out["wait"] = a.wait()
        out["future"] = [x.shape[0] for x in b.get_future().wait()]
    except ftc10d.CollectiveError as exc:
        out["raised"] = type(exc).__name__
    out["seconds"] = time.monotonic() - t0
    if rank == 0:
        later = torch.zeros(N)
        w = dist.all_reduce(later, group=pg, async_op=True)  # on the aborted configuration
        out["later"] = (w.wait(), w.is_success(), w.exception(), len(reports))
        out["reports"] = [type(e).__name__ for e in reports]
        out["is_collective_error"] = all(isinstance(e, (ftc10d.CollectiveError, RuntimeError)) for e in reports)
        out["error_type"] = str(pg.get_error())
    return out


def test_swallowed_failures_complete_and_are_reported_others_raise() -> None:
    job = harness.start(_worker, 3)
    try:
        res = job.collect([0, 1], timeout=90)
    finally:
        job.close()
    for r in (0, 1):
        assert res[r]["healthy"] == 6.0 and res[r]["reports_before"] == 0, res[r]
        assert res[r]["bad_args"] == "InvalidOptionError", res[r]  # bad input is never swallowed
        assert res[r]["seconds"] < 25, res[r]  # released by the failure, not by the op timeout
    swallowing, plain = res[0], res[1]
    assert "raised" not in swallowing, swallowing
    assert swallowing["wait"] is True and swallowing["future"] == [N], swallowing
    assert 1 <= len(swallowing["reports"]) <= 3, swallowing  # a/b may fail together or one by one
    assert swallowing["is_collective_error"], swallowing
    done, ok, exc, count = swallowing["later"]
    assert done is True and ok is True and exc is None, swallowing
    assert count == len(swallowing["reports"]) and swallowing["reports"][-1] == "ProcessGroupAborted", swallowing
    assert swallowing["error_type"] != str(ftc10d.ErrorType.SUCCESS), swallowing  # the group knows it failed
    assert plain.get("raised") in ("PeerFailureError", "ProcessGroupAborted", "CommunicationError"), plain

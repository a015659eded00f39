"""The NCCL scenarios of issue 17, importable without pytest: ``tests/pg/test_nccl.py``
asserts them, ``benchmarks/gpu_check.py`` (``make gpu-check``) runs them on a GPU machine
that may have no pytest. Each ``run_*`` returns the workers' results, each ``check_*`` the
problems found in them (empty: the contract held)."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Callable

import torch

import ftc10d
from tests import harness

T = timedelta(seconds=60)
N = 1 << 20  # floats per tensor (4 MiB)


def _nccl_group(rank: int, world: int, port: int) -> tuple[ftc10d.ProcessGroup, object, list[str]]:
    """An ftc10d NCCL group of ``world`` ranks sharing cuda:0 (distinct NCCL_HOSTID each)."""
    os.environ["NCCL_HOSTID"] = f"ftc10d-test-{rank}"
    torch.cuda.set_device(0)
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, -1, 0, backend="nccl", timeout=T, enable_reconfigure=True)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(1, handles, group=pg)
    return pg, store, handles


def _allreduce_then_kill(rank: int, world: int, port: int) -> dict:
    pg, store, handles = _nccl_group(rank, world, port)
    t = torch.full((N,), float(rank + 1), device="cuda")
    pg.allreduce([t]).wait()
    out: dict = {"sum": float(t[0].item())}
    harness.store_barrier(store, "summed", rank, world)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pending = torch.ones(N, device="cuda")
    t0 = time.monotonic()
    try:
        pg.allreduce([pending]).wait()
        out["killed_op"] = "returned"
    except ftc10d.CollectiveError as exc:
        out["killed_op"] = type(exc).__name__
    out["failed_after_s"] = time.monotonic() - t0
    survivors = handles[: world - 1]
    ftc10d.reconfigure(2, survivors, group=pg)
    t = torch.full((N,), float(rank + 1), device="cuda")
    pg.allreduce([t]).wait()
    out["sum_after"] = float(t[0].item())
    return out


def _survivors(worker: Callable[[int, int, int], dict], resume: bool = False) -> dict:
    """Run ``worker`` on 3 ranks; the results of ranks 0 and 1 (rank 2 is the one the fault hits:
    SIGCONTed at the end with ``resume``)."""
    job = harness.start(worker, 3)
    try:
        return job.collect([0, 1], timeout=180)
    finally:
        if resume:
            job.signal(2, signal.SIGCONT)
        job.close()


def run_kill() -> dict:
    return _survivors(_allreduce_then_kill)


def check_kill(res: dict) -> list[str]:
    problems = []
    for r in (0, 1):
        if res[r]["sum"] != 6.0:
            problems.append(f"rank {r}: all-reduce gave {res[r]['sum']}, not 6")
        if res[r]["killed_op"] not in ("PeerFailureError", "ProcessGroupAborted", "CommunicationError",
                                       "CollectiveTimeoutError"):
            problems.append(f"rank {r}: the op with a killed peer ended with {res[r]['killed_op']}")
        if res[r]["sum_after"] != 3.0:  # the survivors, reconfigured in place
            problems.append(f"rank {r}: after reconfiguring, all-reduce gave {res[r]['sum_after']}, not 3")
    return problems


def _frozen_then_abort(rank: int, world: int, port: int) -> dict:
    pg, store, _ = _nccl_group(rank, world, port)
    harness.store_barrier(store, "ready", rank, world)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the test once the others are done
        return {}
    guard = torch.full((N,), -1.0, device="cuda")
    work = pg.allreduce([guard])
    aborted_at: list[float] = []

    def abort() -> None:
        time.sleep(1.0)
        t0 = time.monotonic()
        pg.abort()
        aborted_at.append(time.monotonic() - t0)

    th = threading.Thread(target=abort)
    th.start()
    out: dict = {}
    try:
        work.wait()
        out["wait"] = "returned"
    except ftc10d.ProcessGroupAborted:
        out["wait"] = "ProcessGroupAborted"
    th.join()
    out["abort_s"] = aborted_at[0]
    torch.cuda.synchronize()
    snapshot = guard.clone()
    time.sleep(2.0)  # any kernel of the aborted generation still running would write now
    torch.cuda.synchronize()
    out["guard_unchanged"] = bool(torch.equal(snapshot, guard))
    return out


def run_frozen() -> dict:
    return _survivors(_frozen_then_abort, resume=True)


def check_frozen(res: dict) -> list[str]:
    problems = []
    for r in (0, 1):
        if res[r]["wait"] != "ProcessGroupAborted":  # never a normal return (raw NCCL's trap)
            problems.append(f"rank {r}: the wait on the aborted op {res[r]['wait']}")
        if res[r]["abort_s"] >= 10:
            problems.append(f"rank {r}: abort() took {res[r]['abort_s']:.1f} s")
        if not res[r]["guard_unchanged"]:
            problems.append(f"rank {r}: the aborted op's output changed after abort() returned")
    return problems

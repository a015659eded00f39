"""Dumps from real multi-process hangs: read by torch's fr_trace and by `ftc10d trace`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from ftc10d._compat import TORCH_VERSION
from tests import harness


def _scenario(rank: int, world: int, port: int, outdir: str, mode: str) -> str:
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(outdir, "rank_")
    os.environ["RANK"] = str(rank)
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=30))
    for _ in range(3):
        dist.all_reduce(torch.ones(4), group=pg)
    if mode == "skip":
        if rank != 2:
            dist.all_reduce(torch.ones(4), group=pg, async_op=True)
    else:  # shape mismatch on rank 1
        dist.all_reduce(torch.ones(5 if rank == 1 else 4), group=pg, async_op=True)
    time.sleep(0.3)
    harness.store_barrier(store, "dump", rank, world)
    return ftc10d.flight_recorder.dump()


def _fr_trace(d: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", d, "-p", "rank_"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def _ftc10d_trace(d: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftc10d", "trace", d, *extra], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("mode", ["skip", "shape"])
def test_torch_fr_trace_and_ftc10d_trace_read_our_dumps(tmp_path: os.PathLike, mode: str) -> None:
    d = str(tmp_path)
    paths = harness.run(_scenario, 3, d, mode)
    assert sorted(os.path.basename(p) for p in paths.values()) == ["rank_0", "rank_1", "rank_2"]
    # torch 2.11's fr_trace reads only NCCL/XCCL dumps ("name formatting error? gloo != 'nccl'"),
    # whoever wrote them; from 2.13 on it reads Gloo groups' dumps too, and ours.
    out = _fr_trace(d) if TORCH_VERSION >= (2, 13) else None
    ours = _ftc10d_trace(d)
    assert ours.returncode == 1, ours.stdout + ours.stderr
    if mode == "skip":
        assert out is None or "missing ranks: {2}" in out, out
        assert "rank 2 never entered all_reduce #4 of the initial configuration; ranks 0,1 waited" in ours.stdout
    else:
        assert out is None or ("SIZE_OR_SYNTAX_MISMATCH" in out and "Culprit rank 1" in out), out
        assert "input_sizes differ at collective #4" in ours.stdout and "rank 1: [[5]]" in ours.stdout


def _two_generations(rank: int, world: int, port: int, outdir: str) -> dict:
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(outdir, "rank_")
    os.environ["RANK"] = str(rank)
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=1))
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    dist.all_reduce(torch.ones(4), group=pg)
    ftc10d.reconfigure(5, handles, group=pg)
    for _ in range(2):
        dist.all_reduce(torch.ones(4), group=pg)
    if rank == 2:
        harness.store_barrier(store, "frozen", 0, 1)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1.0)  # resumed; the test dumps us by signal
        return {}
    store.wait(["test/frozen/0"])
    with pytest.raises(ftc10d.CollectiveError):
        dist.all_reduce(torch.ones(4), group=pg)  # times out: the abort hook dumps
    path = os.path.join(outdir, f"rank_{rank}")
    assert os.path.exists(path)
    with open(os.path.join(outdir, f"ftc10d-fr-{rank}.json")) as f:
        last = json.load(f)["entries"][-1]
    return {"last": (last["profiling_name"], last["collective_seq_id"], last["state"], last["uuid"], last["error"])}


def test_abort_dump_and_signal_dump_show_the_stuck_op_across_generations(tmp_path: os.PathLike) -> None:
    d = str(tmp_path)
    job = harness.start(_two_generations, 3, d)
    try:
        res = job.collect([0, 1], timeout=60)
        job.signal(2, signal.SIGCONT)
        job.signal(2, signal.SIGUSR2)  # the default dump signal
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(d, "ftc10d-fr-2.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        job.collect([2], timeout=30)
    finally:
        job.close()
    for r in (0, 1):
        name, seq, state, uuid, error = res[r]["last"]
        assert (name, seq, uuid) == ("gloo:all_reduce", 3, 5)
        assert state != "completed" and error in ("timeout", "aborted", "peer failure")
    ours = _ftc10d_trace(d)
    assert ours.returncode == 1
    text = ours.stdout
    assert "the initial configuration: all 3 members completed every recorded collective" in text
    assert "rank 2 never entered all_reduce #3 of generation 5; ranks 0,1 waited" in text, text
    js = json.loads(_ftc10d_trace(d, "--json").stdout)
    assert js["problem"] and [g["missing"] for g in js["generations"]] == [[], [2]]

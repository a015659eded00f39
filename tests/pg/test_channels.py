"""A two-channel group (``ftc10d.pg.channels``): one configuration, a CPU channel and a device
channel, one abort. Proven on CPU with ``cpu:gloo,cuda:gloo-as-nccl``: the device channel is
real Gloo declaring NCCL's abort and wait semantics, so the data path really runs on a second
communicator (its own sockets) and the control path on the first."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from ftc10d.pg import channels
from tests import harness

SPEC = "cpu:gloo,cuda:gloo-as-nccl"
T = timedelta(seconds=30)


def _routing(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, backend=SPEC, timeout=T)
    comm = pg.generation.comm  # type: ignore[union-attr]
    out: dict = {"distinct": comm.data.backend is not comm.control.backend}
    t = torch.full((8,), float(rank + 1))
    w = pg.allreduce([t])
    w.wait()
    out["data"] = (w.comm is comm.data, float(t[0]))
    with channels.control():
        c = torch.full((2,), float(rank + 1))
        w = pg.allreduce([c])
        w.wait()
        out["control"] = (w.comm is comm.control, float(c[0]))
    w = pg.barrier()
    w.wait()
    out["barrier"] = w.comm is comm.control
    # p2p on both channels, interleaved: each channel keeps its own order
    x = torch.zeros(4)
    if rank == 0:
        a = pg.send([torch.full((4,), 7.0)], 1, 0)
        with channels.control():
            b = pg.send([torch.full((4,), 9.0)], 1, 0)
        a.wait()
        b.wait()
    else:
        with channels.control():
            b = pg.recv([x], 0, 0)
        b.wait()
        out["control_recv"] = float(x[0])
        a = pg.recv([x], 0, 0)
        a.wait()
        out["data_recv"] = float(x[0])
    # both channels under one uuid: a reconfigure connects both again, an abort cuts both
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    pg.abort()
    for scope in (False, True):
        try:
            if scope:
                with channels.control():
                    pg.allreduce([torch.ones(1)]).wait()
            else:
                pg.allreduce([torch.ones(1)]).wait()
            out[f"after_abort_{scope}"] = "ran"
        except ftc10d.ProcessGroupAborted:
            out[f"after_abort_{scope}"] = "aborted"
    ftc10d.reconfigure(5, handles, group=pg)
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    with channels.control():
        c = torch.ones(3)
        pg.allreduce([c]).wait()
    out["after_reconfigure"] = (float(t[0]), float(c[0]), pg.generation.comm.data is not comm.data)  # type: ignore
    prefix = f"ftc10d/cfg/5/{SPEC}/"
    out["keys"] = [store.check([f"{prefix}{d}/ep/{rank}"]) for d in ("cpu", "cuda")]
    return out


def test_ops_run_on_their_channel_and_one_abort_cuts_both() -> None:
    res = harness.run(_routing, 2)
    for r in (0, 1):
        got = res[r]
        assert got["distinct"]
        assert got["data"] == (True, 3.0) and got["control"] == (True, 3.0) and got["barrier"], got
        assert got["after_abort_False"] == got["after_abort_True"] == "aborted", got
        assert got["after_reconfigure"] == (2.0, 2.0, True), got
        assert got["keys"] == [True, True], got
    assert res[1]["control_recv"] == 9.0 and res[1]["data_recv"] == 7.0, res[1]


def _killed_in_a_data_op(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, backend=SPEC, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    pg.allreduce([torch.ones(4)]).wait()
    if rank == 2:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        pg.allreduce([torch.ones(1 << 16)]).wait()  # the data channel: polled, as NCCL's
        got = ("completed", None)
    except ftc10d.CollectiveError as exc:
        got = (type(exc).__name__, exc.peer)
    elapsed = time.perf_counter() - t0
    try:
        with channels.control():
            pg.allreduce([torch.ones(1)]).wait()
        control = "ran"
    except ftc10d.ProcessGroupAborted:
        control = "aborted"
    ftc10d.reconfigure(1, [h for i, h in enumerate(handles) if i != 2], group=pg)
    t = torch.ones(2)
    pg.allreduce([t]).wait()
    with channels.control():
        c = torch.ones(2)
        pg.allreduce([c]).wait()
    return {"error": got, "elapsed": elapsed, "control": control, "after": (float(t[0]), float(c[0]))}


def test_a_peer_killed_in_a_data_op_aborts_both_channels() -> None:
    job = harness.start(_killed_in_a_data_op, 3)
    try:
        res = job.collect([0, 1], timeout=90)
    finally:
        job.close()
    for got in res.values():
        assert got["error"] == ("PeerFailureError", 2), got
        assert got["elapsed"] < 10.0, got
        assert got["control"] == "aborted", got
        assert got["after"] == (2.0, 2.0), got


def _defaults(rank: int, world: int, port: int) -> dict:
    os.environ["FTC10D_BACKEND"] = SPEC
    dist.init_process_group("ftc10d", store=harness.client_store(port), rank=rank, world_size=world, timeout=T)
    default = dist.distributed_c10d._get_default_group()
    sub = dist.new_group([0, 1])
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    out = {"default": default._backend_name, "sub": sub._backend_name, "sum": float(t[0])}  # type: ignore
    dist.destroy_process_group()
    return out


def test_init_process_group_and_sub_groups_take_the_channels() -> None:
    res = harness.run(_defaults, 2)
    assert res[0] == res[1] == {"default": SPEC, "sub": SPEC, "sum": 2.0}, res


def test_the_default_is_gloo_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTC10D_BACKEND", raising=False)
    from ftc10d.pg.nccl import unavailable_reason

    expected = "gloo" if unavailable_reason() else channels.CPU_AND_CUDA
    assert channels.default_backend() == expected
    monkeypatch.setenv("FTC10D_BACKEND", SPEC)
    assert channels.default_backend() == SPEC


@pytest.mark.parametrize("spec, message", [
    ("cpu:gloo,cpu:gloo-as-nccl", "a device type is named twice"),
    ("cuda:gloo", "needs a 'cpu:...' channel"),
    ("cpu:nccl,cuda:gloo", "'nccl' does not carry cpu tensors"),
    ("cpu:gloo,cuda:mpi", "'mpi' is not supported"),
    ("cpu:gloo,cuda", "is not DEVICE:BACKEND"),
])
def test_bad_specs_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ftc10d.InvalidOptionError, match=message):
        ftc10d.ProcessGroup(harness.host_store(), 0, 1, backend=spec)


def test_nccl_channel_without_cuda_says_which_channel() -> None:
    from ftc10d.pg.nccl import unavailable_reason

    if not unavailable_reason():
        pytest.skip("CUDA and NCCL are available here: the channel can be made")
    with pytest.raises(ftc10d.InvalidOptionError, match="channel 'cuda': backend 'nccl'"):
        ftc10d.ProcessGroup(harness.host_store(), 0, 1, backend=channels.CPU_AND_CUDA)

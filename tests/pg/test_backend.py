"""The backend adapter interface (``ftc10d.pg.backend``): the registry, each adapter's error
classification, NCCL's availability check, and the generation's handling of an adapter
whose abort does not fail the pending ops (NCCL's) and whose wait does not block (also
NCCL's), exercised over real Gloo sockets by an adapter that declares both."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

import ftc10d
from ftc10d.pg.backend import ADAPTERS, FailureKind, adapter
from ftc10d.pg.gloo import GlooCommunicator
from ftc10d.pg.nccl import NcclCommunicator, unavailable_reason
from tests import harness


def test_the_registry_names_gloo_and_nccl_and_refuses_others() -> None:
    assert set(ADAPTERS) == {"gloo", "nccl", "gloo-as-nccl"}
    assert adapter("gloo") is GlooCommunicator and adapter("nccl") is NcclCommunicator
    assert GlooCommunicator.cut_fails_ops and not GlooCommunicator.poll_wait
    assert not NcclCommunicator.cut_fails_ops and NcclCommunicator.poll_wait
    # the CPU stand-in for NCCL's semantics (two-channel tests, ftc10d.pg.channels)
    as_nccl = adapter("gloo-as-nccl")
    assert issubclass(as_nccl, GlooCommunicator) and not as_nccl.cut_fails_ops and as_nccl.poll_wait
    with pytest.raises(ftc10d.InvalidOptionError, match=r"backend 'mpi' is not supported; choose one of"):
        adapter("mpi")


@pytest.mark.parametrize("text, kind", [
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25292", FailureKind.PEER_CLOSED),
    ("[pair.cc:598] Read error [127.0.0.1]:4567: Connection reset by peer", FailureKind.PEER_CLOSED),
    ("[pair.cc:446] Timed out waiting 30000ms for recv operation to complete", FailureKind.TIMEOUT),
    ("Invalid root rank 7", FailureKind.OTHER),
])
def test_gloo_classifies_its_errors(text: str, kind: FailureKind) -> None:
    comm = GlooCommunicator.__new__(GlooCommunicator)  # classify reads no state
    assert comm.classify(RuntimeError(text)) == kind
    assert comm.classify(TypeError("allreduce(): incompatible function arguments")) == FailureKind.REJECTED_ARGS


@pytest.mark.parametrize("text, kind", [
    ("NCCL error in: ProcessGroupNCCL.cpp:2013, remote process exited or there was a network error, NCCL version "
     "2.28.9 ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
     FailureKind.PEER_CLOSED),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1) ran "
     "for 600008 milliseconds before timing out.", FailureKind.TIMEOUT),
    ("NCCL communicator was aborted on rank 1.", FailureKind.PEER_CLOSED),
    ("CUDA error: an illegal memory access was encountered", FailureKind.OTHER),
])
def test_nccl_classifies_its_errors(text: str, kind: FailureKind) -> None:
    comm = NcclCommunicator.__new__(NcclCommunicator)
    assert comm.classify(RuntimeError(text)) == kind
    assert comm.classify(ValueError("Tensors must be CUDA and dense")) == FailureKind.REJECTED_ARGS


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/pg/test_nccl.py runs NCCL")
def test_nccl_without_cuda_is_a_clear_error_before_anything_is_registered() -> None:
    assert unavailable_reason()
    store = harness.host_store()
    with pytest.raises(ftc10d.InvalidOptionError, match="backend 'nccl': .*Use backend='gloo'"):
        ftc10d.ProcessGroup(store, 0, 1, backend="nccl")
    with pytest.raises(ftc10d.InvalidOptionError, match="backend 'nccl'"):
        ftc10d.ProcessGroup(store, -1, 0, backend="nccl", enable_reconfigure=True)


class _GlooLikeNccl(GlooCommunicator):
    """Real Gloo, declaring NCCL's two capabilities: the generation must abandon every op not
    completed when the abort began, and ftc10d's wait must poll the op's completion."""

    name = "gloo-like-nccl"
    cut_fails_ops = False
    poll_wait = True


def _register() -> None:
    ADAPTERS["gloo-like-nccl"] = f"{__name__}:_GlooLikeNccl"


def _poll_and_abandon(rank: int, world: int, port: int) -> dict:
    _register()
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, backend="gloo-like-nccl", timeout=timedelta(seconds=30))
    t = torch.full((1 << 14,), float(rank + 1))
    pg.allreduce([t]).wait()  # polled: complete, correct
    out = {"sum": float(t[0])}
    harness.store_barrier(store, "first", rank, world)
    if rank == 1:
        harness.store_barrier(store, "aborted", 0, 2)  # never joins the second op: rank 0's stays pending
        return out
    pending = torch.zeros(1 << 14)
    work = pg.allreduce([pending])
    threading.Timer(0.3, pg.abort).start()
    t0 = time.monotonic()
    try:
        work.wait()
        out["waited"] = "returned"
    except ftc10d.ProcessGroupAborted as exc:
        out["waited"] = type(exc).__name__
    out["released_s"] = time.monotonic() - t0
    out["completed"] = work.is_completed()  # abandoned: completed (with its error)
    harness.store_barrier(store, "aborted", 1, 2)
    return out


def test_an_adapter_whose_abort_does_not_fail_ops_still_fails_their_waits() -> None:
    res = harness.run(_poll_and_abandon, 2)
    assert res[0]["sum"] == res[1]["sum"] == 3.0
    assert res[0]["waited"] == "ProcessGroupAborted", res[0]
    assert 0.2 < res[0]["released_s"] < 10 and res[0]["completed"], res[0]


def _subgroups_inherit(rank: int, world: int, port: int) -> dict:
    _register()
    import torch.distributed as dist

    pg = ftc10d.init_process_group("gloo-like-nccl", store=harness.client_store(port), rank=rank, world_size=world,
                                   timeout=timedelta(seconds=30))
    sub = dist.new_group([0, 1])
    split = pg.split_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t, group=sub)
    out = {"sub": sub._backend_name, "split": split._backend_name, "sum": float(t[0]),  # type: ignore[union-attr]
           "poll": sub.generation.comm.poll_wait}  # type: ignore[union-attr]
    dist.destroy_process_group()
    return out


def test_sub_groups_use_their_parents_adapter() -> None:
    """``dist.new_group`` and ``split_group`` on an ftc10d default group carry the parent's
    tensors: they get the parent's adapter, not Gloo's by default."""
    res = harness.run(_subgroups_inherit, 2)
    for r in (0, 1):
        assert res[r] == {"sub": "gloo-like-nccl", "split": "gloo-like-nccl", "sum": 2.0, "poll": True}, res

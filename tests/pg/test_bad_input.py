"""Bad input gets a typed error that says what to do, and costs nothing:
the group keeps its configuration and keeps working."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=30)


def _bad_reconfigures(rank: int, world: int, port: int) -> list:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    other = handles[1 - rank]
    R = ftc10d.ReconfigureOptions
    cases = [
        (R(1, []), ftc10d.InvalidHandleError, "empty"),
        (R(1, set()), ftc10d.InvalidHandleError, "empty"),
        (R(1, [handles[rank], handles[rank]]), ftc10d.DuplicateHandleError, "more than once"),
        (R(1, ["not-a-handle"]), ftc10d.InvalidHandleError, "malformed"),
        (R(1, [handles[rank], 42]), ftc10d.InvalidHandleError, "must be a str"),
        (R(1, handles[rank]), ftc10d.InvalidHandleError, "single str"),
        (R(1, {"a": 1}), ftc10d.InvalidHandleError, "list"),  # type: ignore[arg-type]
        (R(1, [other]), ftc10d.MissingHandleError, "not among"),
        (R("1", handles), ftc10d.InvalidOptionError, "uuid must be an int"),  # type: ignore[arg-type]
        (R(True, handles), ftc10d.InvalidOptionError, "uuid must be an int"),  # type: ignore[arg-type]
        (R(2**63, handles), ftc10d.InvalidOptionError, "64-bit"),
        (R(1, handles, hints={"nccl.blocking": "1"}), ftc10d.InvalidOptionError, "unknown reconfigure hints"),
        (R(1, handles, timeout=timedelta(0)), ftc10d.InvalidOptionError, "positive"),
        (R(1, handles, timeout=5), ftc10d.InvalidOptionError, "timedelta"),  # type: ignore[arg-type]
        ({"uuid": 1, "handles": handles}, ftc10d.InvalidOptionError, "ReconfigureOptions"),
    ]
    seen = []
    for bad in ("7", True, 2**63):  # abandon_reconfigure takes the same uuids as reconfigure
        with pytest.raises(ftc10d.InvalidOptionError, match="uuid must be an int|64-bit"):
            pg.abandon_reconfigure(bad)  # type: ignore[arg-type]
    for opts, exc, words in cases:
        with pytest.raises(exc, match=words):
            pg.reconfigure(opts)
        seen.append(exc.__name__)
        # the group kept its configuration and works
        t = torch.ones(1)
        dist.all_reduce(t, group=pg)
        assert t.item() == 2.0 and pg.uuid is None
    # every typed error is also a DistError, as torch users catch
    assert issubclass(ftc10d.InvalidHandleError, dist.DistError)
    with pytest.raises(ftc10d.InvalidOptionError, match="not in"):
        pg.send([torch.ones(1)], 5)
    with pytest.raises(ftc10d.InvalidOptionError, match="own rank"):
        pg.recv([torch.ones(1)], rank)
    with pytest.raises(ftc10d.InvalidOptionError, match="AllreduceOptions"):
        pg.allreduce([torch.ones(1)], "sum")
    # all_to_all_single's split sizes are refused at the call (Gloo would fail the op at
    # wait(), which reads as a broken configuration and aborts it)
    out, inp = torch.zeros(4), torch.ones(4)
    for outs, ins, words in [([1, 2, 1], [2, 2], "3 entries"), ([2, 2], [3, 2], "add up to 5"),
                             ([2, 2], [-1, 5], "must not be negative"), ([], [], None)]:
        if words is None:  # no split sizes: dim 0 must divide equally
            with pytest.raises(ftc10d.InvalidOptionError, match="divide equally"):
                dist.all_to_all_single(torch.zeros(3), torch.ones(3), group=pg)
        else:
            with pytest.raises(ftc10d.InvalidOptionError, match=words):
                dist.all_to_all_single(out, inp, outs, ins, group=pg)
        seen.append("InvalidOptionError")
    with pytest.raises(ftc10d.InvalidOptionError, match="one size"):
        dist.all_to_all_single(torch.zeros(2), torch.ones(4), group=pg)
    with pytest.raises(ftc10d.InvalidOptionError, match="0-dimensional"):
        pg.alltoall_base(torch.zeros(()), torch.ones(()), [0, 0], [0, 0])
    assert pg.uuid is None and pg.generation is not None and not pg.generation.aborted  # nothing failed
    dist.all_to_all_single(out, inp + rank, [2, 2], [2, 2], group=pg)
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0]
    ftc10d.reconfigure(1, handles, group=pg)  # a good one still works afterwards
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    return seen + [t.item()]


def test_bad_reconfigure_input_is_typed_and_harmless() -> None:
    res = harness.run(_bad_reconfigures, 2)
    assert res[0] == res[1]
    assert res[0][-1] == 2.0


def test_constructor_and_helper_errors() -> None:
    store = harness.host_store()
    with pytest.raises(ftc10d.InvalidOptionError, match=r"backend 'mpi' is not supported; choose one of \['gloo', "
                       r"'nccl', 'gloo-as-nccl'\], or one per device type"):
        ftc10d.ProcessGroup(store, 0, 1, backend="mpi")
    if not torch.cuda.is_available():  # tests/pg/test_nccl.py covers the other side on a GPU
        with pytest.raises(ftc10d.InvalidOptionError, match="backend 'nccl': .*Use backend='gloo'"):
            ftc10d.ProcessGroup(store, 0, 1, backend="nccl")
    with pytest.raises(ftc10d.InvalidOptionError, match="positive"):
        ftc10d.ProcessGroup(store, 0, 1, timeout=timedelta(seconds=-1))
    with pytest.raises(ftc10d.InvalidOptionError, match="rank 3"):
        ftc10d.ProcessGroup(store, 3, 2)
    pg = ftc10d.ProcessGroup(store, -1, 0, enable_reconfigure=True)
    assert pg.supports_reconfigure and ftc10d.supports_reconfigure(pg)
    with pytest.raises(ftc10d.NotConfiguredError, match="call reconfigure"):
        dist.all_reduce(torch.ones(1), group=pg)
    with pytest.raises(ftc10d.NotConfiguredError):
        pg.barrier()
    with pytest.raises(ftc10d.NotConfiguredError):  # not a split-size error: there is no configuration yet
        dist.all_to_all_single(torch.zeros(2), torch.ones(2), group=pg)
    with pytest.raises(ftc10d.InvalidOptionError, match="not an ftc10d group"):
        ftc10d.get_reconfigure_handle(dist.ProcessGroup(0, 1))
    with pytest.raises(ftc10d.InvalidOptionError, match="no default process group"):
        ftc10d.reconfigure(1, [pg.get_reconfigure_handle()])
    # a single-member configuration in this very process
    ftc10d.reconfigure(1, [pg.get_reconfigure_handle()], group=pg)
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [1.0] * 3 and (pg.rank(), pg.size()) == (0, 1)
    pg.shutdown()

"""Every collective torch.distributed and DDP use, through one ftc10d group."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import ftc10d
from ftc10d._compat import TORCH_VERSION
from tests import harness

T = timedelta(seconds=30)


def _gather_tensor(out: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=pg)


def _reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=pg)


def _everything(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    r, n = float(rank), world
    out: dict = {}

    t = torch.full((3,), r)
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = t.tolist()

    t = torch.full((3,), r)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    out["all_reduce_max"] = t.tolist()

    ts = [torch.full((2,), r), torch.full((1,), 2 * r)]
    pg.allreduce_coalesced(ts).wait()
    out["all_reduce_coalesced"] = [x.tolist() for x in ts]

    t = torch.full((2,), r)
    dist.broadcast(t, src=1, group=pg)
    out["broadcast"] = t.tolist()

    t = torch.full((2,), r + 1)
    dist.reduce(t, dst=2, op=dist.ReduceOp.PRODUCT, group=pg)
    out["reduce"] = t.tolist() if rank == 2 else None

    lst = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(lst, torch.full((2,), r), group=pg)
    out["all_gather"] = [x.tolist() for x in lst]

    flat = torch.zeros(2 * n)
    _gather_tensor(flat, torch.full((2,), r), pg)
    out["all_gather_into_tensor"] = flat.tolist()

    outs = [torch.zeros(2 * n), torch.zeros(n)]
    pg.all_gather_single_coalesced(outs, [torch.full((2,), r), torch.full((1,), -r)]).wait()
    out["all_gather_into_tensor_coalesced"] = [x.tolist() for x in outs]

    g = [torch.zeros(1) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((1,), r), g, dst=0, group=pg)
    out["gather"] = [x.item() for x in g] if g else None

    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), 10.0 + i) for i in range(n)] if rank == 1 else None, src=1, group=pg)
    out["scatter"] = s.tolist()

    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.full((2,), r + i) for i in range(n)], group=pg)
    out["reduce_scatter"] = rs.tolist()

    rs = torch.zeros(2)
    _reduce_scatter_tensor(rs, torch.arange(2.0 * n) + r, pg)
    out["reduce_scatter_tensor"] = rs.tolist()

    a2a = [torch.zeros(1) for _ in range(n)]
    try:
        dist.all_to_all(a2a, [torch.full((1,), 10 * r + i) for i in range(n)], group=pg)
        out["all_to_all"] = [x.item() for x in a2a]
    except ftc10d.InvalidOptionError as exc:  # torch 2.11's Gloo has no list all_to_all: a typed error
        out["all_to_all"] = "unsupported" if "does not support alltoall" in str(exc) else str(exc)

    a2s = torch.zeros(n)
    dist.all_to_all_single(a2s, torch.arange(float(n)) + 10 * r, group=pg)
    out["all_to_all_single"] = a2s.tolist()

    dist.barrier(group=pg)
    w = dist.barrier(group=pg, async_op=True)
    w.wait()

    got = torch.zeros(1)
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((1,), r), (rank + 1) % n, pg),
            dist.P2POp(dist.irecv, got, (rank - 1) % n, pg),
        ]
    )
    for q in reqs:
        q.wait()
    out["ring"] = got.item()

    fut = dist.all_reduce(torch.ones(2), group=pg, async_op=True).get_future()
    out["future"] = [x.tolist() for x in fut.wait()]
    out["rank_size"] = (dist.get_rank(pg) if dist.is_initialized() else pg.rank(), dist.get_world_size(pg))
    return out


def test_every_collective_matches_gloo_semantics() -> None:
    n = 3
    res = harness.run(_everything, n)
    for rank, out in res.items():
        r = float(rank)
        assert out["all_reduce"] == [3.0] * 3
        assert out["all_reduce_max"] == [2.0] * 3
        assert out["all_reduce_coalesced"] == [[3.0, 3.0], [6.0]]
        assert out["broadcast"] == [1.0, 1.0]
        assert out["reduce"] == ([6.0, 6.0] if rank == 2 else None)
        assert out["all_gather"] == [[float(i)] * 2 for i in range(n)]
        assert out["all_gather_into_tensor"] == [float(i) for i in range(n) for _ in range(2)]
        assert out["all_gather_into_tensor_coalesced"] == [
            [float(i) for i in range(n) for _ in range(2)],
            [-float(i) for i in range(n)],
        ]
        assert out["gather"] == ([0.0, 1.0, 2.0] if rank == 0 else None)
        assert out["scatter"] == [10.0 + r] * 2
        assert out["reduce_scatter"] == [sum(i + r for i in range(n))] * 2  # sum_i (i + rank)
        expected_rs = [sum(2 * rank + j + i for i in range(n)) for j in range(2)]
        assert out["reduce_scatter_tensor"] == [float(x) for x in expected_rs]
        if TORCH_VERSION < (2, 12) and out["all_to_all"] == "unsupported":
            pass  # as on torch's own Gloo group there
        else:
            assert out["all_to_all"] == [10.0 * i + r for i in range(n)]
        assert out["all_to_all_single"] == [10.0 * i + r for i in range(n)]
        assert out["ring"] == float((rank - 1) % n)
        assert out["future"] == [[3.0, 3.0]]
        assert out["rank_size"] == (rank, n)


def _default_group(rank: int, world: int, port: int) -> dict:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # The harness's store already listens on MASTER_PORT: use it as a client, like torchrun's agent store.
    pg = ftc10d.init_process_group(store=harness.client_store(port), rank=rank, world_size=world, timeout=T)
    assert dist.is_initialized() and dist.group.WORLD is pg
    t = torch.ones(2)
    dist.all_reduce(t)  # no group=: the default group is ours
    handles = harness.exchange(harness.client_store(port), "h", rank, ftc10d.get_reconfigure_handle(), world)
    out = {"before": (dist.get_rank(), dist.get_world_size(), t.tolist())}
    if rank == 0:
        return out
    ftc10d.reconfigure(3, handles[1:])  # group=None: the default group
    t = torch.ones(2)
    dist.all_reduce(t)
    out["after"] = (dist.get_rank(), dist.get_world_size(), dist.get_rank(pg), t.tolist())
    import torch.distributed._functional_collectives as fc

    out["functional"] = fc.all_reduce(torch.ones(2), "sum", group=pg).tolist()
    dist.destroy_process_group()
    out["destroyed"] = not dist.is_initialized()
    return out


def test_init_process_group_makes_ftc10d_the_default_group() -> None:
    res = harness.run(_default_group, 3)
    for rank, out in res.items():
        assert out["before"] == (rank, 3, [3.0, 3.0])
        if rank:
            assert out["after"] == (rank - 1, 2, rank - 1, [2.0, 2.0])
            assert out["functional"] == [2.0, 2.0]
            assert out["destroyed"]

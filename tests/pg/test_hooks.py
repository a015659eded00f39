"""Pre/post/abort hooks with torch 2.14's shapes and ordering."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=30)


def _hooks(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    events: list[tuple] = []
    pg.register_pre_hook(1, lambda a: events.append(("pre1", a.name, a.op_id, a.async_op, len(a.input_tensors),
                                                     len(a.output_tensors), a.root)))
    pg.register_pre_hook(2, lambda a: events.append(("pre2", a.name, a.op_id)))

    def boom(a: object) -> None:
        raise RuntimeError("hook bug")

    pg.register_pre_hook(3, boom)  # a raising hook never breaks the op
    pg.register_post_hook(1, lambda a: events.append(("post1", a.name, a.op_id, isinstance(a.work, dist.Work))))
    with pytest.raises(ftc10d.InvalidOptionError, match="already registered"):
        pg.register_pre_hook(1, lambda a: None)
    with pytest.raises(ftc10d.InvalidOptionError, match="callable"):
        pg.register_post_hook(9, "not callable")  # type: ignore[arg-type]

    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    dist.broadcast(t, src=1, group=pg, async_op=True).wait()
    dist.barrier(group=pg)
    if rank == 0:
        dist.send(torch.ones(1), 1, group=pg)
    else:
        dist.recv(torch.zeros(1), 0, group=pg)
    pg.unregister_pre_hook(2)
    pg.unregister_pre_hook(3)
    dist.all_reduce(t, group=pg)
    with pytest.raises(ftc10d.InvalidOptionError, match="no pre hook"):
        pg.unregister_pre_hook(2)

    aborts: list[bool] = []
    pg.register_abort_hook(1, lambda: aborts.append(pg.generation.aborted))
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    pg.abort()
    pg.abort()  # once per configuration
    ftc10d.reconfigure(1, handles, group=pg)  # the aborted one is not aborted again
    ftc10d.reconfigure(2, handles, group=pg)  # reconfiguring aborts the live one: fires again
    return {"events": [(e[0], str(e[1]).split(".")[-1], *e[2:]) for e in events], "aborts": aborts, "sum": t.tolist()}


def test_hooks_fire_in_order_share_op_id_and_survive_a_raising_hook(caplog: pytest.LogCaptureFixture) -> None:
    res = harness.run(_hooks, 2)
    for rank, out in res.items():
        ev = out["events"]
        names = [e[1] for e in ev if e[0] == "pre1"]
        p2p = "SEND" if rank == 0 else "RECV"
        assert names == ["ALLREDUCE", "BROADCAST", "BARRIER", p2p, "ALLREDUCE"]
        # registration order, and every pre has a post with the same op_id
        first = ev[:3]
        assert [e[0] for e in first] == ["pre1", "pre2", "post1"]
        pre_ids = [e[2] for e in ev if e[0] == "pre1"]
        post_ids = [e[2] for e in ev if e[0] == "post1"]
        assert pre_ids == post_ids == sorted(set(pre_ids))
        assert all(e[3] for e in ev if e[0] == "post1")  # post hooks see the Work
        assert ("pre1", "BROADCAST", pre_ids[1], True, 1, 1, 1) in ev  # async_op and root
        assert not any(e[0] == "pre2" and e[2] == pre_ids[-1] for e in ev)  # unregistered
        assert out["aborts"] == [False, False]  # once per configuration, before it took effect
        assert out["sum"] == [4.0, 4.0]

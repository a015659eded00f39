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

    pg.register_post_hook(1, lambda a: events.append(("post1", a.name, a.op_id, isinstance(a.work, dist.Work))))
    pg.register_pre_hook(4, lambda a: events.append(("first4",)))
    pg.register_pre_hook(4, lambda a: events.append(("pre4", a.name)))  # same id: replaces it, in its place
    with pytest.raises(ftc10d.InvalidOptionError, match="callable"):
        pg.register_post_hook(9, "not callable")  # type: ignore[arg-type]
    pg.unregister_post_hook(77)  # an unknown id: nothing happens (torch's semantics)

    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    dist.broadcast(t, src=1, group=pg, async_op=True).wait()
    dist.barrier(group=pg)
    if rank == 0:
        dist.send(torch.ones(1), 1, group=pg)
    else:
        dist.recv(torch.zeros(1), 0, group=pg)
    pg.unregister_pre_hook(2)
    pg.unregister_pre_hook(4)
    dist.all_reduce(t, group=pg)
    pg.unregister_pre_hook(2)  # twice: a no-op

    def boom(a: object) -> None:
        raise ValueError("hook bug")

    # A pre-hook that raises: the caller gets its error and the op is not issued.
    pg.register_pre_hook(5, boom)
    seq = pg.generation.collective_seq
    with pytest.raises(ValueError, match="hook bug"):
        dist.all_reduce(torch.full((2,), 100.0), group=pg)
    issued = pg.generation.collective_seq - seq
    pg.unregister_pre_hook(5)
    # A post-hook that raises: the caller gets its error after the op was issued; it runs on.
    pg.register_post_hook(6, boom)
    u = torch.ones(2)
    with pytest.raises(ValueError, match="hook bug"):
        dist.all_reduce(u, group=pg)
    pg.unregister_post_hook(6)
    dist.all_reduce(t, group=pg)  # pairs with the other rank's: the raising pre-hook's op was never sent
    dist.barrier(group=pg)  # u's reduction (issued) is done by now on both ranks

    aborts: list[bool] = []
    pg.register_abort_hook(1, lambda: aborts.append(pg.generation.aborted))
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    pg.abort()
    pg.abort()  # once per configuration
    ftc10d.reconfigure(1, handles, group=pg)  # the aborted one is not aborted again
    # Both connected before either moves on: a member that reconfigures again at once cuts the
    # pairs of the configuration a slower peer may still be connecting (it would get
    # ReconfigureConnectError: seen once under heavy load).
    harness.store_barrier(store, "connected", rank, world)
    ftc10d.reconfigure(2, handles, group=pg)  # reconfiguring aborts the live one: fires again
    return {"events": [(e[0], str(e[1]).split(".")[-1], *e[2:]) if len(e) > 1 else e for e in events],
            "aborts": aborts, "sum": t.tolist(), "posted": u.tolist(), "issued": issued}


def test_hooks_fire_in_order_share_op_id_and_raise_as_torch_does() -> None:
    res = harness.run(_hooks, 2)
    for rank, out in res.items():
        ev = out["events"]
        names = [e[1] for e in ev if e[0] == "pre1"]
        p2p = "SEND" if rank == 0 else "RECV"
        # ..., then the op whose pre-hook raised, the one whose post-hook raised, and two more
        assert names == ["ALLREDUCE", "BROADCAST", "BARRIER", p2p, "ALLREDUCE", "ALLREDUCE", "ALLREDUCE",
                         "ALLREDUCE", "BARRIER"]
        # registration order, and every issued op's pre has a post with the same op_id
        first = ev[:4]
        assert [e[0] for e in first] == ["pre1", "pre2", "pre4", "post1"]
        assert ("first4",) not in ev
        pre_ids = [e[2] for e in ev if e[0] == "pre1"]
        post_ids = [e[2] for e in ev if e[0] == "post1"]
        assert pre_ids == sorted(set(pre_ids))
        assert post_ids == pre_ids[:5] + pre_ids[6:]  # no post for the op a pre-hook stopped
        assert all(e[3] for e in ev if e[0] == "post1")  # post hooks see the Work
        assert ("pre1", "BROADCAST", pre_ids[1], True, 1, 1, 1) in ev  # async_op and root
        assert not any(e[0] == "pre2" and e[2] == pre_ids[4] for e in ev)  # unregistered
        assert out["aborts"] == [False, False]  # once per configuration, before it took effect
        assert out["issued"] == 0  # the raising pre-hook's op was not issued
        assert out["sum"] == [8.0, 8.0]
        assert out["posted"] == [2.0, 2.0]  # the raising post-hook's op was issued and completed

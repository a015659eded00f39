"""Reconfigure in place: shrink, grow, merge, join, renumbering, and uuid rules.

Real processes, real Gloo sockets, a real TCPStore hosted by the test process.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from ftc10d import _compat
from ftc10d.membership.tcp import ReconnectingTCPStore
from tests import harness

T = timedelta(seconds=20)


def _sum_of_ranks(pg: ftc10d.ProcessGroup) -> float:
    t = torch.tensor([float(pg.rank())])
    dist.all_reduce(t, group=pg)
    return t.item()


def _identity_and_shrink(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    out: dict = {"handle_stable": pg.get_reconfigure_handle() == handles[rank]}
    ftc10d.reconfigure(1, handles, group=pg).wait()
    out["identity"] = (pg.rank(), pg.size(), _sum_of_ranks(pg), pg.uuid)
    # drop the last rank
    if rank == world - 1:
        return out
    ftc10d.reconfigure(2, handles[:-1], group=pg)
    out["drop_last"] = (pg.rank(), pg.size(), _sum_of_ranks(pg), dist.get_world_size(pg))
    # drop a middle rank (1): survivors renumbered by position
    if rank == 1:
        return out
    survivors = [h for i, h in enumerate(handles[:-1]) if i != 1]
    ftc10d.reconfigure(3, survivors, group=pg)
    out["drop_middle"] = (pg.rank(), pg.size(), _sum_of_ranks(pg))
    out["handle_still_valid"] = pg.get_reconfigure_handle() == handles[rank]
    return out


def test_identity_then_shrink_renumbers_by_position() -> None:
    res = harness.run(_identity_and_shrink, 4)
    for r in range(4):
        assert res[r]["handle_stable"]
        assert res[r]["identity"] == (r, 4, 6.0, 1)
    for r in range(3):
        assert res[r]["drop_last"] == (r, 3, 3.0, 3)
    assert res[0]["drop_middle"] == (0, 2, 1.0)
    assert res[2]["drop_middle"] == (1, 2, 1.0)  # old rank 2 is now rank 1
    assert res[2]["handle_still_valid"]


def _singles_and_back(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(100 + rank, [handles[rank]], group=pg)  # everyone alone
    alone = (pg.rank(), pg.size(), _sum_of_ranks(pg))
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    ftc10d.reconfigure(200, handles, group=pg)  # and back together
    together = (pg.rank(), pg.size(), _sum_of_ranks(pg))
    return alone, t.tolist(), together


def test_scale_down_to_singles_and_back_up() -> None:
    res = harness.run(_singles_and_back, 3)
    for r, (alone, t, together) in res.items():
        assert alone == (0, 1, 0.0)
        assert t == [1.0, 1.0, 1.0]
        assert together == (r, 3, 3.0)


def _merge(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    half = rank // 2  # two disjoint groups {0,1} and {2,3}, created unconfigured
    pg = ftc10d.ProcessGroup(store, -1, 0, timeout=T, enable_reconfigure=True)
    mine = harness.exchange(store, f"half{half}", rank % 2, pg.get_reconfigure_handle(), 2)
    ftc10d.reconfigure(10 + half, mine, group=pg)
    before = (pg.rank(), pg.size(), _sum_of_ranks(pg))
    everyone = harness.exchange(store, "all", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(20, everyone, group=pg)
    return before, (pg.rank(), pg.size(), _sum_of_ranks(pg))


def test_merge_two_disjoint_groups() -> None:
    res = harness.run(_merge, 4)
    for r, (before, after) in res.items():
        assert before == (r % 2, 2, 1.0)
        assert after == (r, 4, 6.0)


def _late_join(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    if rank < world - 1:
        pg = ftc10d.ProcessGroup(store, rank, world - 1, timeout=T)
        first = _sum_of_ranks(pg)
    else:
        pg = ftc10d.ProcessGroup(store, -1, 0, timeout=T, enable_reconfigure=True)
        first = None
        with pytest.raises(ftc10d.NotConfiguredError, match="reconfigure"):
            pg.allreduce([torch.ones(1)])
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(5, handles, group=pg)
    return first, (pg.rank(), pg.size(), _sum_of_ranks(pg))


def test_late_join() -> None:
    res = harness.run(_late_join, 4)
    for r in range(3):
        assert res[r] == (3.0, (r, 4, 6.0))
    assert res[3] == (None, (3, 4, 6.0))


def _set_of_handles(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, -1, 0, timeout=T, enable_reconfigure=True)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(1, set(handles), group=pg)
    return pg.get_reconfigure_handle(), pg.rank(), _sum_of_ranks(pg)


def test_set_of_handles_is_ranked_in_sorted_order() -> None:
    res = harness.run(_set_of_handles, 3)
    order = sorted(h for h, _, _ in res.values())
    for handle, rank, total in res.values():
        assert rank == order.index(handle)
        assert total == 3.0


def _p2p(rank: int, world: int, port: int) -> list:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(3, list(reversed(handles)), group=pg)  # ranks reversed
    me, n = pg.rank(), pg.size()
    got = torch.zeros(2)
    send = dist.isend(torch.full((2,), float(me)), (me + 1) % n, group=pg)
    dist.recv(got, (me - 1) % n, group=pg)
    send.wait()
    return [me, got.tolist()]


def test_send_recv_after_reconfigure() -> None:
    res = harness.run(_p2p, 3)
    for r, (me, got) in res.items():
        assert me == 2 - r
        assert got == [float((me - 1) % 3)] * 2


def _reuse(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    out: dict = {}
    if rank < world - 1:
        pg = ftc10d.ProcessGroup(store, rank, world - 1, timeout=T)
        handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world - 1)
        ftc10d.reconfigure(42, handles, group=pg)
        # same uuid, same members: detected locally
        with pytest.raises(ftc10d.UuidReusedError, match="42"):
            ftc10d.reconfigure(42, handles, group=pg)
        out["still_works"] = _sum_of_ranks(pg)  # kept its configuration
    else:
        pg = ftc10d.ProcessGroup(store, -1, 0, timeout=T, enable_reconfigure=True)
    harness.store_barrier(store, "b1", rank, world)
    # a newcomer that never saw uuid 42 must detect the reuse too, as must everyone
    everyone = harness.exchange(store, "all", rank, pg.get_reconfigure_handle(), world)
    with pytest.raises(ftc10d.UuidReusedError, match="42"):
        ftc10d.reconfigure(42, everyone, group=pg)
    ftc10d.reconfigure(43, everyone, group=pg)
    out["after_retry"] = (pg.rank(), pg.size(), _sum_of_ranks(pg))
    return out


def test_every_rank_detects_reused_uuid() -> None:
    res = harness.run(_reuse, 4)
    for r in range(3):
        assert res[r]["still_works"] == 3.0
    for r in range(4):
        assert res[r]["after_retry"] == (r, 4, 6.0)


def _timeout_then_retry(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    if rank == world - 1:
        return None  # never shows up for uuid 7
    t0 = time.monotonic()
    with pytest.raises(ftc10d.ReconfigureTimeoutError, match=rf"rank\(s\) \[{world - 1}\]"):
        ftc10d.reconfigure(7, handles, group=pg, timeout=timedelta(seconds=1))
    waited = time.monotonic() - t0
    with pytest.raises(ftc10d.ProcessGroupAborted):
        pg.allreduce([torch.ones(1)])  # the old configuration was aborted by the attempt
    ftc10d.reconfigure(8, handles[:-1], group=pg)
    return waited, pg.size(), _sum_of_ranks(pg)


def test_timed_out_reconfigure_is_retryable_with_fresh_uuid() -> None:
    res = harness.run(_timeout_then_retry, 3)
    for r in range(2):
        waited, size, total = res[r]
        assert 0.9 < waited < 15
        assert (size, total) == (2, 1.0)


def _abandon(rank: int, world: int, port: int) -> tuple:
    import threading

    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    t0 = time.monotonic()
    if rank == world - 1:  # arrives after the others gave uuid 9 up: its slot holds a tombstone
        store.wait(["gave-up/0", "gave-up/1"], timedelta(seconds=30))
        t0 = time.monotonic()
        with pytest.raises(ftc10d.ReconfigureAbandonedError, match="given up before rank 2"):
            ftc10d.reconfigure(9, handles, group=pg)
    else:
        if rank == 0:  # e.g. its membership moved on while it waited: abort() from another thread
            threading.Timer(0.5, pg.abort).start()
        with pytest.raises(ftc10d.ReconfigureAbandonedError, match="given up before rank 2"):
            ftc10d.reconfigure(9, handles, group=pg)  # rank 2 is not coming; the timeout is 20 s
        store.set(f"gave-up/{rank}", "1")
    waited = time.monotonic() - t0
    ftc10d.reconfigure(10, handles, group=pg)  # nothing was connected for 9: a fresh uuid works
    return waited, _sum_of_ranks(pg)


def test_abort_gives_a_pending_rendezvous_up_on_every_member() -> None:
    res = harness.run(_abandon, 3)
    for r in range(3):
        waited, total = res[r]
        assert waited < 10, f"rank {r} waited {waited:.1f} s: the rendezvous was not given up"
        assert total == 3.0


def _abandon_before_it_begins(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    if rank == 0:  # its membership moved on before its own thread reached the rendezvous
        pg.abandon_reconfigure(9, "a newer configuration was adopted")
    harness.store_barrier(store, "gave-up", rank, world)
    t0 = time.monotonic()
    with pytest.raises(ftc10d.ReconfigureAbandonedError, match="a newer configuration was adopted"):
        ftc10d.reconfigure(9, handles, group=pg)  # the timeout is 20 s
    waited = time.monotonic() - t0
    ftc10d.reconfigure(10, handles, group=pg)  # a fresh uuid connects everyone
    return waited, _sum_of_ranks(pg)


def test_a_rendezvous_given_up_before_it_begins_ends_at_once_on_every_member() -> None:
    """Chaos finding 16: the membership gave up the rendezvous of an older configuration
    (abort()) a moment before its member's thread entered it; nothing was pending yet, so
    that member waited its whole 7.5-s timeout for members that had gone on."""
    res = harness.run(_abandon_before_it_begins, 3)
    for r in range(3):
        waited, total = res[r]
        assert waited < 10, f"rank {r} waited {waited:.1f} s in a rendezvous given up before it began"
        assert total == 3.0


def _arrive_after_it_was_given_up(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    if rank == 0:  # gives uuid 9 up and leaves its rendezvous before anyone else arrives
        pg.abandon_reconfigure(9, "a newer configuration was adopted")
        with pytest.raises(ftc10d.ReconfigureAbandonedError):
            ftc10d.reconfigure(9, handles, group=pg)
        store.set("left-9", "1")
    else:
        store.wait(["left-9"], timedelta(seconds=30))
    t0 = time.monotonic()
    if rank != 0:
        with pytest.raises(ftc10d.ReconfigureAbandonedError, match=f"given up before rank {rank} of 3 arrived "
                           r"\(a newer configuration was adopted\)"):
            ftc10d.reconfigure(9, handles, group=pg)
    waited = time.monotonic() - t0
    ftc10d.reconfigure(10, handles, group=pg)
    return waited, _sum_of_ranks(pg)


def test_members_arriving_after_a_rendezvous_was_given_up_are_told_so_not_that_the_uuid_was_reused() -> None:
    """CI failure 2026-12-04: the members that reached uuid 9's rendezvous after the one that
    gave it up had left got UuidReusedError (the uuid counted as used), an error that reads as
    a caller's bug, instead of the ReconfigureAbandonedError their slot's tombstone records."""
    res = harness.run(_arrive_after_it_was_given_up, 3)
    for r in range(3):
        waited, total = res[r]
        assert waited < 10, f"rank {r} waited {waited:.1f} s at a rendezvous given up before it arrived"
        assert total == 3.0


class _SlowCloneStore(ReconnectingTCPStore):
    """A store whose second connection takes seconds to open, as one TCPStore connect in
    about 28 does on the chaos machine (a 5-s resolver stall inside torch's client)."""

    def clone(self) -> "_SlowCloneStore":
        time.sleep(4.0)
        return _SlowCloneStore(self._host, self._port, self._timeout)


def _abandon_slow_clone(rank: int, world: int, port: int) -> tuple:
    import threading

    store = _SlowCloneStore("127.0.0.1", port, timedelta(seconds=60))
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    if rank == 0:
        # Alone in the rendezvous of uuid 9: the others went straight to uuid 10 (they
        # adopted the newer configuration first). Its membership moves on and aborts it.
        threading.Timer(0.5, pg.abort).start()
        t0 = time.monotonic()
        with pytest.raises(ftc10d.ReconfigureAbandonedError):
            ftc10d.reconfigure(9, handles, group=pg)
        waited = time.monotonic() - t0
    else:
        waited = 0.0
    ftc10d.reconfigure(10, handles, group=pg)
    return waited, _sum_of_ranks(pg)


def test_abort_gives_a_pending_rendezvous_up_without_waiting_for_a_new_store_connection() -> None:
    """Chaos long run, die_send seed 1612815966 (4.6 s stall): the member waiting alone in a
    superseded rendezvous woke only when its tombstones landed, and they are written on a
    fresh store connection; one slow connect stalled the whole job. The waiter itself must
    give up as soon as its group is aborted."""
    res = harness.run(_abandon_slow_clone, 3)
    waited, total = res[0]
    assert waited < 2.0, f"rank 0 waited {waited:.1f} s in a rendezvous it had given up"
    assert all(res[r][1] == 3.0 for r in range(3))


def _after_kill(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    _sum_of_ranks(pg)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(ftc10d.PeerFailureError) as info:
        dist.all_reduce(torch.ones(1000), group=pg)
    err = info.value
    ftc10d.reconfigure(9, [h for i, h in enumerate(handles) if i != 1], group=pg)
    return err.peer, err.op, err.seq, err.uuid, pg.rank(), _sum_of_ranks(pg)


def test_peer_killed_error_names_it_then_survivors_reconfigure() -> None:
    job = harness.start(_after_kill, 4)
    try:
        res = job.collect([0, 2, 3], timeout=60)
    finally:
        job.close()
    for r, (peer, op, seq, uuid, new_rank, total) in res.items():
        assert (peer, op, seq, uuid) == (1, "all_reduce", 2, None)
        assert new_rank == (r if r == 0 else r - 1)
        assert total == 3.0


def _native_api(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, -1, 0, timeout=T, enable_reconfigure=True)
    assert dist._supports_reconfigure(pg)
    handles = harness.exchange(store, "h", rank, dist._get_reconfigure_handle(pg), world)
    dist._reconfigure(uuid=11, handles=handles, group=pg).wait()
    opts = dist.distributed_c10d.ReconfigureOptions()
    opts.uuid = 12
    opts.handles = set(handles)
    opts.timeout = timedelta(seconds=10)
    pg.reconfigure(opts).wait()
    return pg.uuid, pg.size(), _sum_of_ranks(pg)


@pytest.mark.skipif(not _compat.HAS_NATIVE_RECONFIGURE, reason="torch < 2.14 has no native reconfigure API")
def test_torch_native_reconfigure_api_drives_our_group() -> None:
    res = harness.run(_native_api, 2)
    assert all(v == (12, 2, 1.0) for v in res.values())


CONNECT_S = 10.0  # the group's (connect) timeout in the next test


def _abandon_while_connecting(rank: int, world: int, port: int) -> tuple:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=CONNECT_S))
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    if rank == world - 1:
        # Arrives (its slot, as the rendezvous writes it) and never connects: a member that
        # froze, or went on to a newer configuration, between its arrival and its connect.
        store.set(f"ftc10d/cfg/9/rank/{rank}", f"{handles[rank]}|{rank}")
        harness.store_barrier(store, "gave-up", rank, world)
        ftc10d.reconfigure(10, handles, group=pg)
        return 0.0, _sum_of_ranks(pg)
    import threading

    # Their membership moves on while the connect waits: abort() from another thread.
    threading.Timer(1.5, pg.abort).start()
    t0 = time.monotonic()
    with pytest.raises(ftc10d.ReconfigureAbandonedError, match="given up while its members connected"):
        ftc10d.reconfigure(9, handles, group=pg)  # everyone arrived; rank 2 never connects
    waited = time.monotonic() - t0
    harness.store_barrier(store, "gave-up", rank, world)
    ftc10d.reconfigure(10, handles, group=pg)  # a fresh uuid connects everyone
    return waited, _sum_of_ranks(pg)


def test_abort_gives_a_rendezvous_up_while_its_members_connect() -> None:
    """Chaos (issue 28's FT-HSDP run): every member of a configuration arrived, one went on to
    a newer configuration before connecting, and another stayed 38 s in Gloo's full-mesh
    connect, which cannot be interrupted; its peers then removed it as a no-show (the last
    holder of a shard). Now the connect can be given up like the wait before it: abort()
    returns the reconfigure at once (ReconfigureAbandonedError), and everyone connects on a
    fresh uuid. (Here the connect waits in the store for rank 2's address: the given-up
    connect still holds the group's store connection until its timeout, so the members'
    next store request waits for it; in the chaos run it waited on a TCP connect.)"""
    res = harness.run(_abandon_while_connecting, 3, timeout=120)
    for r in (0, 1):
        assert res[r][0] < CONNECT_S / 2, f"rank {r} waited {res[r][0]:.1f} s in a connect it had given up"
    for r in range(3):
        assert res[r][1] == 3.0

"""The collective check: ranks that call different collectives get a typed error on every
rank before any data moves, and the group stays usable (no SIGABRT inside Gloo)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftc10d
from ftc10d.pg import signature
from tests import harness

T = timedelta(seconds=30)

#: (case, what rank 0 calls, what rank 1 calls): each pair would crash or corrupt without the check.
MISMATCHES = ["shape", "dtype", "op", "reduce_op", "root", "ndim"]


def _call(pg: ftc10d.ProcessGroup, case: str, rank: int) -> None:
    if case == "shape":
        dist.all_reduce(torch.ones(4 + rank), group=pg)
    elif case == "dtype":
        dist.all_reduce(torch.ones(4, dtype=(torch.float32, torch.float64)[rank]), group=pg)
    elif case == "op":
        t = torch.ones(4)
        dist.all_reduce(t, group=pg) if rank == 0 else dist.broadcast(t, 0, group=pg)
    elif case == "reduce_op":
        dist.all_reduce(torch.ones(4), op=(dist.ReduceOp.SUM, dist.ReduceOp.MAX)[rank], group=pg)
    elif case == "root":
        dist.broadcast(torch.ones(4), rank, group=pg)
    elif case == "ndim":
        dist.all_reduce(torch.ones(4) if rank == 0 else torch.ones(2, 2), group=pg)


def _mismatch_then_work(rank: int, world: int, port: int) -> dict[str, Any]:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T, check_collectives=True)
    assert pg.check_collectives
    out: dict[str, Any] = {}
    for case in MISMATCHES:
        try:
            _call(pg, case, rank)
            out[case] = "no error"
        except ftc10d.CollectiveMismatchError as exc:
            assert isinstance(exc, ftc10d.InvalidOptionError)  # bad input, not a failure
            out[case] = (exc.op, exc.seq, sorted(exc.signatures), str(exc))
        # the group kept its configuration and still computes right
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        assert t.tolist() == [3.0, 3.0, 3.0], t
        assert pg.get_error() == ftc10d.ErrorType.SUCCESS
    # matching calls of every kind pass the check
    t = torch.arange(4.0)
    dist.broadcast(t, 1, group=pg)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=pg)
    assert [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
    out_t = torch.zeros(2)
    dist.scatter(out_t, [torch.full((2,), 7.0), torch.full((2,), 8.0)] if rank == 0 else None, src=0, group=pg)
    assert out_t.tolist() == [7.0 + rank] * 2
    splits = [1, 1] if rank == 0 else [1, 0]  # uneven: shapes differ across ranks by design
    a2a_out = torch.zeros(2 - rank)
    dist.all_to_all_single(a2a_out, torch.full((2 - rank,), float(rank)), splits, splits, group=pg)
    assert a2a_out.tolist() == ([0.0, 1.0] if rank == 0 else [0.0])
    dist.barrier(group=pg)
    return out


def test_mismatched_collectives_raise_on_every_rank_and_change_nothing() -> None:
    results = harness.run(_mismatch_then_work, 2)
    for case in MISMATCHES:
        r0, r1 = results[0][case], results[1][case]
        assert r0 != "no error" and r1 != "no error", (case, r0, r1)
        assert r0[1:3] == r1[1:3], (case, r0, r1)  # same seq number, both ranks' signatures
        assert r0[2] == [0, 1]
        assert "Nothing was sent" in r0[3] and "rank 0:" in r0[3] and "rank 1:" in r0[3]
    assert "float32[4]" in results[0]["shape"][3] and "float32[5]" in results[0]["shape"][3]
    assert "float64" in results[1]["dtype"][3]
    assert "op=SUM" in results[0]["reduce_op"][3] and "op=MAX" in results[0]["reduce_op"][3]


def _ddp_with_check(rank: int, world: int, port: int) -> list[float]:
    os.environ[signature.CHECK_ENV] = "1"  # the environment switch, as a launcher would set it
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    assert pg.check_collectives
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4), process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 + rank * 10 + step)
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [float(p.detach().double().sum()) for p in model.parameters()]


def test_ddp_trains_with_the_check_on() -> None:
    results = harness.run(_ddp_with_check, 2)
    assert results[0] == results[1]


def test_signature_says_what_must_agree() -> None:
    ar = dist.AllreduceOptions()
    ar.reduceOp = dist.ReduceOp.AVG
    assert signature.signature("all_reduce", -1, ar, [torch.ones(2, 3)], []) == "all_reduce(float32[2,3]) op=AVG"
    assert signature.signature("broadcast", 1, None, [torch.ones(2, dtype=torch.int8)], []) == \
        "broadcast(int8[2]) root=1"
    # scatter's inputs exist on the root only: the outputs are compared
    assert signature.signature("scatter", 0, None, [], [torch.ones(3)]) == "scatter(float32[3]) root=0"
    # uneven all-to-all: rows may differ, trailing dims and dtype may not
    assert signature.signature("all_to_all_single", -1, None, [torch.ones(5, 2)], []) == \
        signature.signature("all_to_all_single", -1, None, [torch.ones(1, 2)], [])
    assert signature.signature("all_to_all", -1, None, [torch.ones(5), torch.ones(1)], []) == \
        "all_to_all(float32 float32)"
    assert signature.signature("barrier", -1, None, [], []) == "barrier()"


def test_the_switch_follows_ftc10d_and_torch_debug_variables() -> None:
    assert signature.enabled_from_env({}) is False
    assert signature.enabled_from_env({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) is True
    assert signature.enabled_from_env({"TORCH_DISTRIBUTED_DEBUG": "INFO"}) is False
    assert signature.enabled_from_env({signature.CHECK_ENV: "1"}) is True
    assert signature.enabled_from_env({signature.CHECK_ENV: "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) is False
    with pytest.raises(ftc10d.InvalidOptionError, match="FTC10D_CHECK_COLLECTIVES"):
        signature.enabled_from_env({signature.CHECK_ENV: "maybe"})

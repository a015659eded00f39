"""torch's own debugging and p2p helpers on an ftc10d default group, with torch's semantics
(issue 25): ``dist.recv`` without ``src`` (receive from any source: torch reads the sender
with ``work._source_rank()``) and ``dist.monitored_barrier`` (rank 0 names the ranks that did
not arrive within the timeout, in Gloo's words), checked against torch's native Gloo group on
the same torch."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests import harness

T = timedelta(seconds=10)


def _recv_any(rank: int, world: int, port: int, backend: str) -> dict:
    harness.init_default_group(backend, rank, world, port, T)
    out: dict = {}
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            t = torch.zeros(2)
            src = dist.recv(t)  # no src: from any source
            got[src] = t.tolist()
        out["got"] = got
    else:
        dist.send(torch.full((2,), float(rank)), dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("backend", ["gloo", "ftc10d"])
def test_recv_from_any_source_returns_the_sender(backend: str) -> None:
    res = harness.run(_recv_any, 3, backend)
    assert res[0]["got"] == {1: [1.0, 1.0], 2: [2.0, 2.0]}


def _monitored(rank: int, world: int, port: int, backend: str, late: int) -> dict:
    harness.init_default_group(backend, rank, world, port, T)
    dist.monitored_barrier(timeout=T)  # everyone arrives: passes
    out: dict = {"first": True}
    if rank == late:
        time.sleep(4.0)  # misses rank 0's 1.5-s window
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1.5), wait_all_ranks=True)
        out["second"] = "passed"
    except RuntimeError as exc:
        out["second"] = f"{type(exc).__name__}: {exc}"
    return out


def test_monitored_barrier_names_the_rank_that_did_not_arrive_as_on_gloo() -> None:
    """Rank 2 arrives 4 s late at a 1.5-s monitored barrier (wait_all_ranks): rank 0 raises
    Gloo's message naming rank 2, and every rank ends as it does on torch's Gloo group."""
    outcome = {b: harness.run(_monitored, 3, b, 2) for b in ("gloo", "ftc10d")}
    for res in outcome.values():
        assert all(r["first"] for r in res.values())
        text = res[0]["second"]
        assert "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1500 ms" in text, text

    def kind(text: str) -> str:
        return text.split(":")[0]

    assert {r: kind(v["second"]) for r, v in outcome["ftc10d"].items()} == \
        {r: kind(v["second"]) for r, v in outcome["gloo"].items()}, outcome

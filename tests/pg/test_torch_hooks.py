"""torch's NanCheckHook, TORCH_DIST_NAN_CHECK and FlightRecorderHook on an ftc10d group,
side by side with torch's native Gloo group on the same torch (issue 15, item 2).

Each case is symmetric (both ranks raise, or neither), so that a raise, which sends
nothing, leaves no peer waiting. torch < 2.14 has none of these hooks: skipped.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch._C._distributed_c10d as C
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=30)

pytestmark = pytest.mark.skipif(getattr(C, "NanCheckHook", None) is None,
                                reason=f"torch {torch.__version__} has no NanCheckHook / FlightRecorderHook (2.14+)")


def _group(kind: str, store: dist.Store, rank: int, world: int, **kw: Any) -> Any:
    if kind == "ftc10d":
        return ftc10d.ProcessGroup(store, rank, world, timeout=T, **kw)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=T)
    return dist.group.WORLD


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        w = fn()
        if w is not None:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _nan_cases(pg: Any, rank: int) -> dict[str, str]:
    nan = lambda: torch.tensor([float("nan"), 1.0])  # noqa: E731
    ok = lambda: torch.tensor([0.0, 1.0])  # noqa: E731
    cases: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(nan(), group=pg),
        "all_reduce int": lambda: dist.all_reduce(torch.tensor([1, 2]), group=pg),
        "all_gather": lambda: dist.all_gather([ok(), ok()], nan(), group=pg),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(4), nan(), group=pg),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2), torch.tensor([float("nan"), 1.0, 2.0, 3.0]), group=pg),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(2), nan(), group=pg),
        "reduce": lambda: dist.reduce(nan(), dst=0, group=pg),
        "gather": lambda: dist.gather(nan(), [ok(), ok()] if rank == 0 else None, dst=0, group=pg),
        # NaN in what a non-root will receive, in a receive buffer, in an output: not checked
        "broadcast, NaN on the non-root": lambda: dist.broadcast(nan() if rank == 1 else ok(), src=0, group=pg),
        "recv into a NaN buffer": lambda: (dist.send(ok(), dst=1, group=pg) if rank == 0
                                           else dist.recv(nan(), src=0, group=pg)),
        "NaN in the outputs": lambda: dist.all_gather([nan(), nan()], ok(), group=pg),
    }
    return {name: _outcome(fn) for name, fn in cases.items()}


def _nan_scenario(rank: int, world: int, port: int, kind: str, how: str) -> dict[str, Any]:
    if how == "env":
        os.environ["TORCH_DIST_NAN_CHECK"] = "1"
    pg = _group(kind, harness.client_store(port), rank, world)
    handle = C.NanCheckHook.attach(pg) if how == "attach" else None
    out = _nan_cases(pg, rank)
    if handle is not None:
        handle.remove()
        handle.remove()  # idempotent, as torch's
        out["after remove()"] = _outcome(lambda: dist.all_reduce(torch.tensor([float("nan")]), group=pg))
    dist.barrier(group=pg)
    return out


@pytest.mark.parametrize("how", ["attach", "env"])
def test_nan_check_behaves_as_on_torchs_native_gloo_group(how: str) -> None:
    native = harness.run(_nan_scenario, 2, "gloo", how)
    ours = harness.run(_nan_scenario, 2, "ftc10d", how)
    for r in range(2):
        assert ours[r] == native[r], f"rank {r}: ftc10d {ours[r]} vs torch {native[r]}"
    raised = [c for c, o in native[0].items() if o != "returned"]
    assert "all_reduce" in raised and "all_reduce int" not in raised  # the comparison has teeth


def _nan_subgroup(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ["TORCH_DIST_NAN_CHECK"] = "1"
    ftc10d.init_process_group(store=harness.client_store(port), rank=rank, world_size=world, timeout=T)
    sub = dist.new_group([0, 1])
    return {"sub": _outcome(lambda: dist.all_reduce(torch.tensor([float("nan")]), group=sub)),
            "sub is ftc10d": isinstance(sub, ftc10d.ProcessGroup)}


def test_torch_dist_nan_check_covers_sub_groups_made_by_torch() -> None:
    out = harness.run(_nan_subgroup, 2)
    for r in range(2):
        assert out[r] == {"sub": "RuntimeError: NaN found in input tensor.", "sub is ftc10d": True}, out[r]


def _recorded(kind: str, pg: Any) -> int:
    """Ops of ``pg`` in the flight recorder torch's hook (or ours) writes to."""
    if kind == "ftc10d":
        return sum(e.pg_id == pg._group_id for e in ftc10d.flight_recorder.get_recorder().entries())
    return len(pickle.loads(C._dump_fr_trace()).get("entries", []))


def _fr_scenario(rank: int, world: int, port: int, kind: str) -> list[int]:
    kw = {"flight_recorder": False} if kind == "ftc10d" else {}
    pg = _group(kind, harness.client_store(port), rank, world, **kw)
    t = torch.ones(3)
    counts = [_recorded(kind, pg)]
    dist.all_reduce(t, group=pg)
    counts.append(_recorded(kind, pg))  # not attached: nothing (torch's Gloo: its own record)
    handle = C.FlightRecorderHook.attach(pg)
    dist.all_reduce(t, group=pg)
    dist.broadcast(t, src=0, group=pg)
    counts.append(_recorded(kind, pg))  # two ops recorded
    handle.remove()
    dist.all_reduce(t, group=pg)
    counts.append(_recorded(kind, pg))  # removed: no more
    return counts


def test_flight_recorder_hook_records_while_attached() -> None:
    """On torch's Gloo group the hook's records sit beside Gloo's own (2.14 writes both,
    2.15 only Gloo's): what both torch versions show is that the two ops issued while
    attached are in the buffer. On ftc10d (its recorder off for this group) the hook
    records exactly those two ops, and nothing before or after."""
    native = harness.run(_fr_scenario, 2, "gloo")
    ours = harness.run(_fr_scenario, 2, "ftc10d")
    for r in range(2):
        assert native[r][2] - native[r][1] >= 2, native
        assert ours[r] == [0, 0, 2, 2], ours


def _fr_default_on(rank: int, world: int, port: int) -> list[int]:
    pg = ftc10d.ProcessGroup(harness.client_store(port), rank, world, timeout=T)  # records by default
    t = torch.ones(3)
    handle = C.FlightRecorderHook.attach(pg)
    dist.all_reduce(t, group=pg)
    handle.remove()
    first = _recorded("ftc10d", pg)
    dist.all_reduce(t, group=pg)
    nan_a, nan_b = C.NanCheckHook.attach(pg), C.NanCheckHook.attach(pg)
    nan_a.remove()  # b's check stays
    out = [first, _recorded("ftc10d", pg), int(_outcome(lambda: dist.all_reduce(torch.tensor([float("nan")]),
                                                                                   group=pg)) != "returned")]
    nan_b.remove()
    dist.barrier(group=pg)
    return out


def test_removing_a_hook_takes_away_only_what_its_attach_added() -> None:
    """A group records by default: a FlightRecorderHook attached and removed on it leaves it
    recording (its abort dumps depend on it). Two NaN checks: removing one leaves the other."""
    out = harness.run(_fr_default_on, 2)
    for r in range(2):
        assert out[r] == [1, 2, 1], out[r]

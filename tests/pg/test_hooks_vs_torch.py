"""Hooks: the same script on torch's native Gloo group and on an ftc10d group, same torch.

torch 2.14 gave every ProcessGroup pre/post hooks; an ftc10d group must behave the same
way (issue 15, item 2): an id registered again replaces its hook, unregistering an
unknown id does nothing, a raising pre-hook raises to the caller, a raising post-hook
raises after the op was issued. On torch < 2.14 the native group has no hooks: skipped.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=30)

pytestmark = pytest.mark.skipif(not hasattr(dist.ProcessGroup, "register_pre_hook"),
                                reason=f"torch {torch.__version__} has no native process-group hooks (2.14+)")


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return f"{type(exc).__name__}: {'hook bug' in str(exc)}"
    return "returned"


def _scenario(rank: int, world: int, port: int, kind: str) -> dict:
    store = harness.client_store(port)
    if kind == "ftc10d":
        pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=T)
        pg = dist.group.WORLD
    events: list[str] = []
    pg.register_pre_hook(4, lambda a: events.append("first"))
    pg.register_pre_hook(4, lambda a: events.append(f"second {str(a.name).split('.')[-1]}"))
    unknown = _outcome(lambda: pg.unregister_post_hook(77))
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    pg.unregister_pre_hook(4)
    twice = _outcome(lambda: pg.unregister_pre_hook(4))

    def boom(a: Any) -> None:
        raise ValueError("hook bug")

    pg.register_pre_hook(5, boom)
    pre = _outcome(lambda: dist.all_reduce(torch.ones(2), group=pg))
    pg.unregister_pre_hook(5)
    pg.register_post_hook(6, boom)
    u = torch.ones(2)
    post = _outcome(lambda: dist.all_reduce(u, group=pg))
    pg.unregister_post_hook(6)
    dist.all_reduce(t, group=pg)
    dist.barrier(group=pg)
    return {"events": events, "unknown": unknown, "twice": twice, "pre": pre, "post": post,
            "t": t.tolist(), "u": u.tolist()}


def test_hooks_behave_as_on_torchs_native_gloo_group() -> None:
    native = harness.run(_scenario, 2, "gloo")
    ours = harness.run(_scenario, 2, "ftc10d")
    for r in range(2):
        assert ours[r] == native[r], f"rank {r}: ftc10d {ours[r]} vs torch {native[r]}"

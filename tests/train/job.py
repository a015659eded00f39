"""The training loop of the Manager tests, shared by forkserver workers (``workers.py``)
and the script that ``ftc10d launch`` runs (``scripts/train_job.py``).

For every committed step it publishes the replica's state fingerprint under
``fp/<step>/<pid>`` through ``publish``: the tests check invariant 1 from those.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable

import torch
from torch import nn

IN, HIDDEN, OUT, GLOBAL_BATCH = 32, 64, 4, 64


def batch_for(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard of step ``step``'s fixed global batch that rank ``rank`` of ``world`` trains on."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
    return x[rank::world], y[rank::world]


def _suicide_hook(manager: Any, die: dict[str, Any], claim: Callable[[str], bool]) -> Any:
    """A pre-hook that SIGKILLs this process as it issues a given op (a fault at an exact point):
    ``{"op": "send"}`` (sending state to a joiner) or ``{"op": "vote"}`` (the commit vote),
    once ``manager.step >= die["after_step"]``; with ``"once"``, only the first process of
    the job to get there dies (``claim`` decides, through the test's store)."""

    def hook(args: Any) -> None:
        if manager.step < die["after_step"]:
            return
        name = str(args.name).lower().replace("_", "")
        hit = (die["op"] == "send" and name.endswith("send")) or (
            die["op"] == "vote" and name.endswith("allreduce") and manager.in_vote)
        if hit and (not die.get("once") or claim(f"die/{die['op']}")):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train_loop(pg: Any, member: Any, opts: dict[str, Any], publish: Callable[[str, str], None],
               rank: int, claim: Callable[[str], bool] = lambda key: True) -> dict[str, Any]:
    """Train to ``opts["steps"]`` committed steps; returns what the tests check."""
    from ftc10d.train import ManagedOptimizer, Manager

    torch.manual_seed(rank + 1000 * int(os.environ.get("FTC10D_RESTART_COUNT", "0")))  # different weights
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = Manager(pg, member, vote=opts.get("vote", "fused"), sync_timeout=opts.get("sync_timeout", 300.0))
    events: list[list[Any]] = []
    manager.add_listener(lambda kind, info: events.append([time.time(), kind, info]))
    ddp = manager.ddp(model)
    die = opts.get("die", {}).get(str(rank))
    if die:
        pg.register_pre_hook(7, _suicide_hook(manager, die, claim))
    opt = ManagedOptimizer(manager, optim)
    steps, aborted = opts["steps"], 0
    veto = opts.get("veto", {}).get(str(rank))  # {"step": s}: veto step s once, before backward
    while manager.step < steps:
        opt.zero_grad()
        x, y = batch_for(manager.step, manager.rank, manager.world_size)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if veto is not None and manager.step == veto["step"]:
            manager.veto(f"test veto of step {veto['step']}")
            veto = None
        loss.backward()
        if opt.step():
            publish(f"fp/{manager.step}/{os.getpid()}", manager.fingerprint())
            publish(f"progress/{os.getpid()}", str(manager.step))
        else:
            aborted += 1
        time.sleep(opts.get("interval", 0.0))
    final = manager.state_hash()
    publish(f"final/{os.getpid()}", final)
    return {"pid": os.getpid(), "steps": manager.step, "aborted": aborted, "final": final, "manager": manager,
            "events": json.loads(json.dumps(events, default=str))}

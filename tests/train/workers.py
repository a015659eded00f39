"""Training workers for the Manager tests (forkserver processes from tests.harness).

Each worker trains a small MLP with torch's DDP through ``Manager.ddp`` and
publishes, for every committed step, its parameter/optimizer fingerprint under
``fp/<step>/<pid>`` in the test's control store: the test checks invariant 1
(every replica that committed step s holds the same bits) from those keys.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from tests.harness import client_store
from tests.membership.workers import _log_to

IN, HIDDEN, OUT, GLOBAL_BATCH = 32, 64, 4, 64


def batch_for(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard of step ``step``'s fixed global batch that rank ``rank`` of ``world`` trains on."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
    return x[rank::world], y[rank::world]


def _suicide_hook(manager: Any, die: dict[str, Any]) -> Any:
    """A pre-hook that SIGKILLs this process as it issues a given op (a fault at an exact point):
    ``{"op": "send"}`` (sending state to a joiner) or ``{"op": "vote"}`` (the commit vote),
    once ``manager.step >= die["after_step"]``."""

    def hook(args: Any) -> None:
        if manager.step < die["after_step"]:
            return
        name = str(args.name).lower().replace("_", "")
        tensors = args.input_tensors
        if die["op"] == "send" and name.endswith("send"):
            os.kill(os.getpid(), signal.SIGKILL)
        if (die["op"] == "vote" and name.endswith("allreduce") and tensors
                and tensors[0].dtype == torch.int64 and tensors[0].numel() == 2):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train_worker(rank: int, world: int, port: int, coordinator: str, opts: dict[str, Any]) -> dict[str, Any]:
    from ftc10d.train import ManagedOptimizer, Manager, init_from_env

    os.environ.update({
        "FTC10D_COORDINATOR": coordinator, "RANK": str(rank % world), "WORLD_SIZE": str(world),
        "FTC10D_HEARTBEAT_TIMEOUT": str(opts.get("hb", 1.0)),
    })
    _log_to(rank)
    control = client_store(port)
    pg, member = init_from_env()
    torch.manual_seed(rank)  # different initial weights: the Manager's first recovery makes them equal
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = Manager(pg, member)
    events: list[list[Any]] = []
    manager.add_listener(lambda kind, info: events.append([time.time(), kind, info]))
    ddp = manager.ddp(model)
    die = opts.get("die", {}).get(str(rank))
    if die:
        pg.register_pre_hook(7, _suicide_hook(manager, die))
    opt = ManagedOptimizer(manager, optim)
    steps, aborted = opts["steps"], 0
    while manager.step < steps:
        opt.zero_grad()
        x, y = batch_for(manager.step, manager.rank, manager.world_size)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if opt.step():
            control.set(f"fp/{manager.step}/{os.getpid()}", manager.fingerprint())
            control.set(f"progress/{os.getpid()}", str(manager.step))
        else:
            aborted += 1
        time.sleep(opts.get("interval", 0.0))
    final = manager.state_hash()
    control.set(f"final/{os.getpid()}", final)
    # Stay until every worker finished, so that a fast one leaving does not fail the others' last step.
    control.add("finished", 1)
    while int(control.add("finished", 0)) < opts.get("finishers", world):
        time.sleep(0.02)
    manager.close()
    return {"pid": os.getpid(), "steps": manager.step, "aborted": aborted, "final": final,
            "events": json.loads(json.dumps(events, default=str))}

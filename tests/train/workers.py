"""Forkserver workers for the Manager tests (tests.harness): the loop is ``job.train_loop``."""

from __future__ import annotations

import os
import time
from typing import Any

from tests.harness import client_store
from tests.membership.workers import _log_to
from tests.train.job import train_loop


def train_worker(rank: int, world: int, port: int, coordinator: str, opts: dict[str, Any]) -> dict[str, Any]:
    from ftc10d.train import init_from_env

    os.environ.update({
        "FTC10D_COORDINATOR": coordinator, "RANK": str(rank % world), "WORLD_SIZE": str(world),
        "FTC10D_HEARTBEAT_TIMEOUT": str(opts.get("hb", 1.0)),
    })
    if opts.get("backend"):
        os.environ["FTC10D_BACKEND"] = opts["backend"]
    _log_to(rank)
    control = client_store(port)
    pg, member = init_from_env()
    out = train_loop(pg, member, opts, control.set, rank, lambda key: control.add(key, 1) == 1, store=control)
    manager = out.pop("manager")
    # Stay until every worker finished, so that a fast one leaving does not fail the others' last step.
    control.add("finished", 1)
    while int(control.add("finished", 0)) < opts.get("finishers", world):
        time.sleep(0.02)
    manager.close()
    from ftc10d.pg.channels import ISSUED

    out["channels"] = dict(ISSUED)
    return out

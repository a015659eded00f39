"""FT-HSDP driven by the Manager (issue 16): 2x2 (FSDP2 inside each replica), real membership,
a rank SIGKILLed. The other replica keeps committing alone; the hit replica's survivor waits
warm; a replacement process started for the dead slot receives its shard from the live rank
of its shard index; both replicas then commit together, and every committed step's shards
are bitwise equal across the replicas (invariant 1 per shard)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftc10d.membership import Coordinator
from tests.harness import client_store, start
from tests.membership.workers import _log_to
from tests.train.hsdp import digest

STEPS = 60
#: Slow enough that the replacement (a fresh process importing torch) joins well before the end.
INTERVAL = 0.1


def hsdp_worker(rank: int, world: int, port: int, coordinator: str, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from ftc10d.train import ManagedOptimizer, Manager, init_from_env
    from ftc10d.train.fsdp import HSDPGroups, local_state
    from ftc10d.train.mesh import HSDPLayout

    slot = int(opts.get("slot", rank))
    os.environ.update({"FTC10D_COORDINATOR": coordinator, "RANK": str(slot), "WORLD_SIZE": "4",
                       "FTC10D_HEARTBEAT_TIMEOUT": "1.0"})
    _log_to(rank + 10 * int("slot" in opts))
    control = client_store(port)
    pg, member = init_from_env()
    groups = HSDPGroups(pg.store, HSDPLayout(replicas=2, shard_size=2), slot, timedelta(seconds=60))
    manager = Manager(pg, member, hsdp=groups, check_every=5)
    events: list[tuple[str, dict]] = []
    manager.add_listener(lambda kind, info: events.append((kind, dict(info))))
    mesh = manager.device_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager.fsdp(model, opt)
    mopt = ManagedOptimizer(manager, opt)
    while manager.step < STEPS:
        mopt.zero_grad()
        with manager.collectives():
            gen = torch.Generator().manual_seed(1000 * manager.step + slot)
            model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        if mopt.step():
            control.set(f"d/{manager.step}/{slot}/{os.getpid()}", digest(local_state(model, opt)))
            control.set(f"progress/{slot}", str(manager.step))
        time.sleep(INTERVAL)
    control.add("finished", 1)
    while int(control.add("finished", 0)) < 4:
        time.sleep(0.02)
    manager.close()
    return {"pid": os.getpid(), "slot": slot, "steps": manager.step,
            "events": [(k, {x: v for x, v in i.items() if isinstance(v, (int, str, list))}) for k, i in events]}


def _progress(store: Any, slot: int) -> int:
    key = f"progress/{slot}"
    return int(store.get(key)) if store.check([key]) else 0


def _wait(store: Any, slot: int, step: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while _progress(store, slot) < step:
        assert time.monotonic() < deadline, f"slot {slot} did not reach step {step}"
        time.sleep(0.05)


@pytest.mark.skipif(os.environ.get("FTC10D_TEST_HSDP_MANAGER") != "1", reason=(
    "known open defect (issue 16): a collective that fails inside FSDP2's backward (a peer died mid-step) "
    "leaves that rank's FSDP2 state half-way, and its later backwards issue no reduce-scatter: the job then "
    "hangs at the next step (1 run in 8 here). Needs a shard group whose failed ops complete as no-ops "
    "and report to the Manager (torchft's error-swallowing wrapper). FTC10D_TEST_HSDP_MANAGER=1 runs it"))
def test_a_2x2_hsdp_job_survives_a_sigkill_and_the_replacement_gets_its_shard(coordinator: Coordinator) -> None:
    job = start(hsdp_worker, 4, coordinator.address, {})
    joiner = None
    try:
        _wait(job.store, 0, 8)
        victim = job.pid(1)
        job.signal(1, signal.SIGKILL)
        stalled_at = _progress(job.store, 0)
        _wait(job.store, 2, stalled_at + 8)  # replica 1 trains on alone
        waiting_at = _progress(job.store, 0)
        joiner = start(hsdp_worker, 1, coordinator.address, {"slot": 1}, store=job.store)
        results = job.collect([0, 2, 3], timeout=150)
        results[4] = joiner.collect(timeout=60)[0]
    finally:
        job.close()
        if joiner is not None:
            joiner.close()
    assert all(r["steps"] == STEPS for r in results.values()), results
    assert waiting_at <= stalled_at + 1, "the hit replica's survivor committed without its replica"
    store = job.store
    pids = {r["slot"]: r["pid"] for r in results.values()}
    pids_1 = [victim, pids[1]]
    compared = {0: 0, 1: 0}
    for step in range(1, STEPS + 1):
        d = {s: store.get(f"d/{step}/{s}/{p}").decode() for s, p in pids.items() if store.check([f"d/{step}/{s}/{p}"])}
        for p in pids_1:
            if store.check([f"d/{step}/1/{p}"]):
                d.setdefault(1, store.get(f"d/{step}/1/{p}").decode())
        if 0 in d and 2 in d:
            assert d[0] == d[2], (step, "shard 0 differs across the replicas")
            compared[0] += 1
        if 1 in d and 3 in d:
            assert d[1] == d[3], (step, "shard 1 differs across the replicas")
            compared[1] += 1
    # before the kill, and after the replacement joined: both replicas committed together
    assert compared[0] >= 8 + 5 and compared[1] >= 8 + 5, compared
    recovered = [e for e in results[4]["events"] if e[0] == "recovered"]
    assert recovered, results[4]["events"]
    assert any(e[0] == "waiting" for e in results[0]["events"]), results[0]["events"]

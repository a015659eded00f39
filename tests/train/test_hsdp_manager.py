"""FT-HSDP driven by the Manager (issue 16): 2x2 (FSDP2 inside each replica), real membership,
a rank SIGKILLed. The other replica keeps committing alone; the hit replica's survivor waits
warm; a replacement process started for the dead slot receives its shard from the live rank
of its shard index; both replicas then commit together, and every committed step's shards
are bitwise equal across the replicas (invariant 1 per shard).

The kill lands anywhere in a step, often inside FSDP2's backward: the shard group swallows
its failure (``ProcessGroup.swallow_errors``) so that FSDP2 runs to the end of the backward
and the Manager discards the step; without it this test hung about one run in five (the
failed reduce-scatter left FSDP2's per-module state half-way)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

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
    replicas, shard_size = int(opts.get("replicas", 2)), int(opts.get("shard_size", 2))
    os.environ.update({"FTC10D_COORDINATOR": coordinator, "RANK": str(slot), "WORLD_SIZE": str(replicas * shard_size),
                       "FTC10D_HEARTBEAT_TIMEOUT": "1.0"})
    if opts.get("backend"):
        os.environ["FTC10D_BACKEND"] = opts["backend"]
    _log_to(rank + 10 * int("slot" in opts))
    control = client_store(port)
    pg, member = init_from_env()
    groups = HSDPGroups(pg.store, HSDPLayout(replicas=replicas, shard_size=shard_size), slot, timedelta(seconds=60),
                        backend=pg.adapter_name)
    manager = Manager(pg, member, hsdp=groups, check_every=5, sync_timeout=float(opts.get("sync_timeout", 300)))
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
    control.set(f"handle/{slot}", pg.get_reconfigure_handle())  # what a launcher reports when it dies
    split = opts.get("split_vote")
    if split:
        _split_vote(manager, control, slot, split)
        manager.add_listener(lambda kind, info: control.set(
            f"d/{info['step']}/{slot}/{os.getpid()}", digest(local_state(model, opt))) if kind == "rolled_forward"
            else None)
    while manager.step < int(opts.get("steps", STEPS)):
        mopt.zero_grad()
        with manager.collectives():
            gen = torch.Generator().manual_seed(1000 * manager.step + slot)
            model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        if mopt.step():
            control.set(f"d/{manager.step}/{slot}/{os.getpid()}", digest(local_state(model, opt)))
            control.set(f"e/{manager.step}/{os.getpid()}", str(manager.commit_epoch))  # its configuration
            control.set(f"progress/{slot}", str(manager.step))
            if split and manager.step == split["step"] + 1 and slot != split["loser"]:
                control.add(f"committed/{split['step']}", 1)
        time.sleep(INTERVAL)
    control.add("finished", 1)
    while int(control.add("finished", 0)) < replicas * shard_size:
        time.sleep(0.02)
    manager.close()
    from ftc10d.pg.channels import ISSUED

    return {"pid": os.getpid(), "slot": slot, "steps": manager.step, "channels": dict(ISSUED),
            "events": [(k, {x: v for x, v in i.items() if isinstance(v, (int, str, list))}) for k, i in events]}


def _split_vote(manager: Any, control: Any, slot: int, spec: dict[str, Any]) -> None:
    """The vote of step ``spec["step"]`` completes everywhere; every slot but the loser commits
    and publishes its shard's digest; then the loser SIGKILLs the victim, reports its exit (as a
    launcher does) and makes its own vote fail (``Manager.after_vote``), as Gloo fails the last
    receive of an all-reduce whose peer died mid-way. Ordered through the store, not by timing."""
    from ftc10d import PeerFailureError

    step, loser, victim = spec["step"], spec["loser"], spec["victim"]
    control.set(f"pid/{slot}", str(os.getpid()))
    if slot != loser:
        return
    fired = [False]

    def after_vote() -> None:
        if manager.step != step or fired[0]:
            return
        fired[0] = True
        deadline = time.monotonic() + 60
        while int(control.add(f"committed/{step}", 0)) < 3:
            assert time.monotonic() < deadline, "the winners did not commit"
            time.sleep(0.01)
        os.kill(int(control.get(f"pid/{victim}")), signal.SIGKILL)
        manager.member.report_exit(control.get(f"handle/{victim}").decode())
        raise PeerFailureError(f"test: the vote of step {step} lost its last message (slot {victim} died)",
                               op="allreduce", seq=-1, uuid=manager.pg.uuid)

    manager.after_vote = after_vote


def _progress(store: Any, slot: int) -> int:
    key = f"progress/{slot}"
    return int(store.get(key)) if store.check([key]) else 0


def _wait(store: Any, slot: int, step: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while _progress(store, slot) < step:
        assert time.monotonic() < deadline, f"slot {slot} did not reach step {step}"
        time.sleep(0.05)


def _digests(store: Any, step: int, pids: dict[int, list[int]]) -> dict[int, str]:
    """Slot -> the digest published for ``step`` by any of the slot's processes."""
    out: dict[int, str] = {}
    for s, ps in pids.items():
        for p in ps:
            key = f"d/{step}/{s}/{p}"
            if store.check([key]):
                out.setdefault(s, store.get(key).decode())
    return out


def _check_shards(store: Any, pids: dict[int, list[int]], at_least: int) -> None:
    """Every step: the two replicas' copies of each shard are bitwise equal (invariant 1 per shard)."""
    compared = {0: 0, 1: 0}
    for step in range(1, STEPS + 1):
        d = _digests(store, step, pids)
        for shard, (a, b) in enumerate(((0, 2), (1, 3))):
            if a in d and b in d:
                assert d[a] == d[b], (step, f"shard {shard} differs across the replicas")
                compared[shard] += 1
    assert compared[0] >= at_least and compared[1] >= at_least, compared


def _run(coordinator: Coordinator, victim_slot: int, opts: dict[str, Any], kill: bool) -> tuple[Any, dict, int, int]:
    job = start(hsdp_worker, 4, coordinator.address, opts)
    joiner = None
    try:
        _wait(job.store, 0, 8)
        victim = job.pid(victim_slot)
        if kill:
            job.signal(victim_slot, signal.SIGKILL)
        else:  # the split vote kills it at its step
            deadline = time.monotonic() + 60
            while job.procs[victim_slot].is_alive():
                assert time.monotonic() < deadline, "the victim was not killed"
                time.sleep(0.05)
        stalled_at = _progress(job.store, 0)
        other = 2 if victim_slot in (0, 1) else 0
        _wait(job.store, other, stalled_at + 8)  # the other replica trains on alone
        waiting_at = _progress(job.store, 1 - victim_slot % 2 + 2 * (victim_slot // 2))
        joiner = start(hsdp_worker, 1, coordinator.address, {**opts, "slot": victim_slot}, store=job.store)
        results = job.collect([r for r in range(4) if r != victim_slot], timeout=150)
        results[4] = joiner.collect(timeout=60)[0]
    finally:
        job.close()
        if joiner is not None:
            joiner.close()
    assert all(r["steps"] == STEPS for r in results.values()), results
    return job.store, results, victim, waiting_at - stalled_at


def _pids(results: dict, victim_slot: int, victim: int) -> dict[int, list[int]]:
    pids: dict[int, list[int]] = {r["slot"]: [r["pid"]] for r in results.values()}
    pids[victim_slot].insert(0, victim)
    return pids


def test_a_2x2_hsdp_job_survives_a_sigkill_and_the_replacement_gets_its_shard(coordinator: Coordinator) -> None:
    store, results, victim, waited = _run(coordinator, 1, {}, kill=True)
    assert waited <= 1, "the hit replica's survivor committed without its replica"
    # before the kill, and after the replacement joined: both replicas committed together
    _check_shards(store, _pids(results, 1, victim), 8 + 5)
    recovered = [e for e in results[4]["events"] if e[0] == "recovered"]
    assert recovered, results[4]["events"]
    assert any(e[0] == "waiting" for e in results[0]["events"]), results[0]["events"]


def test_a_vote_that_failed_on_every_holder_of_a_shard_rolls_forward(coordinator: Coordinator) -> None:
    """Step 10's vote completes on slots 0, 1, 2 (they apply it) and fails on slot 3; slot 1
    dies. Slot 3 is then the only live holder of shard 1 and one step behind the job: no
    transfer can bring shard 1 to step 11 (without the roll forward: StateLostError). It
    applies step 10 with the reduced gradients it kept, bitwise equal to what slot 1
    committed, and the replacement of slot 1 receives shard 1 from it."""
    step = 10
    store, results, victim, _ = _run(coordinator, 1, {"split_vote": {"step": step, "loser": 3, "victim": 1}},
                                     kill=False)
    pids = _pids(results, 1, victim)
    rolled = [e for e in results[3]["events"] if e[0] == "rolled_forward"]
    assert [e[1]["step"] for e in rolled] == [step + 1], results[3]["events"]
    d = _digests(store, step + 1, {1: [victim], 3: pids[3]})
    assert d.get(1) is not None and d.get(1) == d.get(3), ("slot 3's rolled-forward shard differs from what slot 1 "
                                                            "committed", d)
    _check_shards(store, pids, 8 + 5)


def test_one_replica_losing_a_rank_is_state_lost_after_the_sync_timeout(coordinator: Coordinator) -> None:
    """R = 1 (FSDP2 alone, no replica to take a shard from), 1x3: a SIGKILLed rank's shard has
    no holder left. The survivors wait for a holder to come back (one removed on suspicion may
    be alive: it rejoins with its shard), then raise StateLostError naming the shard once the
    Manager's sync_timeout (5 s here) passed, without ever training on a second history."""
    job = start(hsdp_worker, 3, coordinator.address, {"replicas": 1, "shard_size": 3, "sync_timeout": 5})
    try:
        _wait(job.store, 0, 5)
        job.signal(2, signal.SIGKILL)  # 2 of 3 left: a majority, the membership moves on by itself
        t0 = time.monotonic()
        try:
            job.collect([0, 1], timeout=60)
            raise AssertionError("the survivor trained on without shard 1")
        except AssertionError as exc:
            text = str(exc)
        took = time.monotonic() - t0
    finally:
        job.close()
    assert "StateLostError" in text and "shard 2 of the 1x3 mesh is lost" in text, text
    assert "no live rank holds it" in text and "came back within the Manager's sync_timeout (5 s)" in text, text
    assert 5 <= took < 40, took  # the heartbeat timeout (1 s), the 5-s wait and a recovery

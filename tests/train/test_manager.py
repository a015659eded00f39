"""The step-commit Manager under real faults: DDP over real Gloo, SIGKILL/SIGSTOP,
replacements that receive their state from a live peer.

Invariant 1 is checked on every committed step: each worker publishes its
state fingerprint for every step it committed, and all fingerprints of a step
must be equal; at the end every live worker's sha256 of its state is equal.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch.distributed as dist

from ftc10d.membership import Coordinator
from tests.harness import Job, start
from tests.train.workers import train_worker



def progress(store: dist.TCPStore, pid: int) -> int:
    key = f"progress/{pid}"
    return int(store.get(key)) if store.check([key]) else 0


def wait_progress(job: Job, rank: int, step: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while progress(job.store, job.pid(rank)) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} did not reach step {step}")
        failed = [r for r, p in enumerate(job.procs) if p.exitcode == 1]  # 1: the harness caught an exception
        if failed:
            job.collect(failed, timeout=5)  # raises with the worker's traceback
        time.sleep(0.01)


def check_invariant(store: dist.TCPStore, pids: list[int], steps: int) -> int:
    """Every step committed by several workers has one fingerprint; returns how many steps were compared.

    A step that a worker applied alone and then rolled back (it received the job's state in its
    place: ``rolledback/<step>/<pid>``) is not compared: nobody else applied it."""
    compared = 0
    for s in range(1, steps + 1):
        keys = [f"fp/{s}/{p}" for p in pids
                if store.check([f"fp/{s}/{p}"]) and not store.check([f"rolledback/{s}/{p}"])]
        values = set(store.multi_get(keys)) if keys else set()
        assert len(values) <= 1, f"replicas differ after committed step {s}: {len(values)} distinct states"
        compared += len(keys) > 1
    return compared


def test_kill_one_of_four_then_a_replacement_joins(coordinator: Coordinator) -> None:
    steps = 60
    job = start(train_worker, 4, coordinator.address, {"steps": steps, "interval": 0.01, "finishers": 4})
    joiner = None
    try:
        wait_progress(job, 0, 15)
        victim = job.pid(1)
        job.signal(1, signal.SIGKILL)
        wait_progress(job, 0, 25)
        # A replacement process: it joins, receives model + optimizer + step from a peer, and finishes with them.
        joiner = start(train_worker, 1, coordinator.address, {"steps": steps, "finishers": 4}, store=job.store)
        results = job.collect([0, 2, 3], timeout=120)
        results[4] = joiner.collect(timeout=60)[0]
    finally:
        job.close()
        if joiner is not None:
            joiner.close()
    pids = [r["pid"] for r in results.values()] + [victim]
    assert check_invariant(job.store, pids, steps) >= steps - 1
    finals = {r["final"] for r in results.values()}
    assert len(finals) == 1, "live replicas differ at the end"
    assert all(r["steps"] == steps for r in results.values())
    recovered = [e for e in results[4]["events"] if e[1] == "recovered"]
    assert recovered and recovered[0][2]["step"] > 25, recovered


def test_frozen_member_is_fenced_and_rejoins_with_the_committed_state(coordinator: Coordinator) -> None:
    steps, hb = 50, 0.5
    job = start(train_worker, 4, coordinator.address, {"steps": steps, "interval": 0.01, "hb": hb, "finishers": 4})
    try:
        wait_progress(job, 0, 10)
        job.signal(2, signal.SIGSTOP)
        frozen_at = progress(job.store, job.pid(2))
        wait_progress(job, 0, frozen_at + 10)  # the others went on without it
        resumed = time.time()
        job.signal(2, signal.SIGCONT)
        results = job.collect(timeout=120)
    finally:
        job.close()
    fenced = [e[0] for e in results[2]["events"] if e[1] == "fenced"]
    assert fenced and fenced[0] - resumed < 10, "the resumed member must learn at once that it was removed"
    assert check_invariant(job.store, [r["pid"] for r in results.values()], steps) >= steps - 1
    assert len({r["final"] for r in results.values()}) == 1, "live replicas differ at the end"
    kinds = [e[1] for e in results[2]["events"]]
    assert "fenced" in kinds and "recovered" in kinds, kinds
    assert all(r["steps"] == steps for r in results.values())


@pytest.mark.parametrize("vote", ["fused", "separate"])
def test_member_dies_during_the_commit_vote(coordinator: Coordinator, vote: str) -> None:
    """The vote with the last gradient bucket (default) or an all-reduce of its own."""
    steps = 40
    job = start(train_worker, 4, coordinator.address, {"steps": steps, "interval": 0.01, "finishers": 3, "vote": vote,
                                                       "die": {"3": {"op": "vote", "after_step": 12}}})
    try:
        results = job.collect([0, 1, 2], timeout=120)
    finally:
        job.close()
    assert job.procs[3].exitcode == -signal.SIGKILL
    pids = [r["pid"] for r in results.values()] + [job.pid(3)]
    assert check_invariant(job.store, pids, steps) >= steps - 1
    assert len({r["final"] for r in results.values()}) == 1
    # every survivor threw the interrupted step away (or, on a starved machine, was itself
    # removed meanwhile, rejoined and received the committed state)
    assert all(r["steps"] == steps and (r["aborted"] >= 1 or any(e[1] == "fenced" for e in r["events"]))
               for r in results.values()), \
        {r: (v["steps"], v["aborted"], [e[1] for e in v["events"]]) for r, v in results.items()}


@pytest.mark.parametrize("vote", ["fused", "separate"])
def test_a_veto_on_one_rank_stops_the_step_on_every_rank(coordinator: Coordinator, vote: str) -> None:
    steps = 12
    job = start(train_worker, 3, coordinator.address,
                {"steps": steps, "finishers": 3, "vote": vote, "veto": {"1": {"step": 5}}})
    try:
        results = job.collect(timeout=120)
    finally:
        job.close()
    assert all(r["steps"] == steps and r["aborted"] == 1 for r in results.values()), results
    assert check_invariant(job.store, [r["pid"] for r in results.values()], steps) == steps
    assert len({r["final"] for r in results.values()}) == 1


def test_fresh_members_never_restart_a_job_that_lost_its_state_from_scratch(coordinator: Coordinator) -> None:
    """Both holders of the state die (exits confirmed, as a launcher reports them); a late
    worker is admitted alone. It must not train from step 0 as if the job were new:
    StateLostError, and nothing committed."""
    first = start(train_worker, 2, coordinator.address, {"steps": 1000, "interval": 0.01})
    try:
        wait_progress(first, 0, 5)
        cfg = coordinator.agreement().latest()
        assert cfg is not None and cfg.size == 2
        for r in range(2):
            first.signal(r, signal.SIGKILL)
        for handle in cfg.handles:
            coordinator.agreement().report_exit(handle)
        _late_worker_finds_the_state_lost(
            coordinator, first, r"StateLostError: the job committed step \d+ of epoch \d+ .*they hold nothing")
    finally:
        first.close()


def _late_worker_finds_the_state_lost(coordinator: Coordinator, first: Job, match: str) -> None:
    """A worker started now (alone) must raise StateLostError and commit nothing."""
    late = start(train_worker, 1, coordinator.address, {"steps": 10, "sync_timeout": 3.0}, store=first.store)
    try:
        with pytest.raises(AssertionError, match=match):
            late.collect(timeout=60)
    finally:
        late.close()
    assert not first.store.check([f"fp/1/{late.pid(0)}"]) and not first.store.check([f"fp/6/{late.pid(0)}"])


def test_a_straggler_after_everyone_left_does_not_train_the_job_again(coordinator: Coordinator) -> None:
    """The job finished and every worker closed at step 5; a late worker is admitted alone
    and holds nothing: JobFinished at once (the holders left on purpose, nobody will come
    back: waiting ``sync_timeout`` for them would only hang the launcher), nothing committed."""
    first = start(train_worker, 2, coordinator.address, {"steps": 5})
    try:
        assert all(r["steps"] == 5 for r in first.collect(timeout=120).values())
        late = start(train_worker, 1, coordinator.address, {"steps": 10, "sync_timeout": 300.0}, store=first.store)
        try:
            with pytest.raises(AssertionError, match="JobFinished: the job finished at step 5 .*hold nothing"):
                late.collect(timeout=60)  # far below sync_timeout: it did not wait for a holder
        finally:
            late.close()
        assert not first.store.check([f"fp/1/{late.pid(0)}"]) and not first.store.check([f"fp/6/{late.pid(0)}"])
    finally:
        first.close()


def test_a_member_frozen_until_the_job_finished_leaves_when_it_resumes(coordinator: Coordinator) -> None:
    """Rank 2 is SIGSTOPped, removed, and the other two finish and close at step 30 while it
    is stopped. On SIGCONT it finds itself fenced, rejoins alone, holds an older step than
    the job's last one: JobFinished well within sync_timeout, and it committed nothing more."""
    steps, hb = 30, 0.5
    job = start(train_worker, 3, coordinator.address,
                {"steps": steps, "interval": 0.01, "hb": hb, "finishers": 2, "sync_timeout": 300.0})
    try:
        wait_progress(job, 0, 5)
        job.signal(2, signal.SIGSTOP)
        frozen_at = progress(job.store, job.pid(2))
        # the configuration of its last published commit (published before its progress)
        key = f"epoch/{frozen_at}/{job.pid(2)}"
        frozen_epoch = int(job.store.get(key)) if job.store.check([key]) else None
        done = job.collect([0, 1], timeout=120)
        assert all(r["steps"] == steps for r in done.values())
        job.signal(2, signal.SIGCONT)
        with pytest.raises(AssertionError, match=f"JobFinished: the job finished at step {steps} "):
            job.collect([2], timeout=60)
    finally:
        job.close()
    # Not "progress == frozen_at": SIGSTOP can land between a commit and its publication, which
    # then comes on resume (a commit made before the freeze, in the configuration of the one
    # before). A commit after the removal would have been made in a later configuration: none
    # may exist. (Not "epoch 1": a worker admitted late makes the job's first steps epoch 2.)
    pid, last = job.pid(2), progress(job.store, job.pid(2))
    assert last <= frozen_at + 1, (last, frozen_at)
    later = [s for s in range(frozen_at + 1, steps + 1) if job.store.check([f"epoch/{s}/{pid}"])
             and (s > frozen_at + 1 or frozen_epoch not in (None, int(job.store.get(f"epoch/{s}/{pid}"))))]
    assert not later, f"the straggler committed steps {later} after it was removed"


def test_bad_manager_options_are_rejected() -> None:
    from ftc10d import InvalidOptionError
    from ftc10d.train import Manager

    with pytest.raises(InvalidOptionError, match="vote="):
        Manager(None, None, vote="maybe")


def test_source_dies_while_sending_state_to_a_joiner_and_two_failures_in_a_row(coordinator: Coordinator) -> None:
    """Rank 1 is killed and, 30 ms later, rank 2 too; a replacement joins; the survivor that is
    the source of its state (0 or 3) dies as it starts sending; the replacement gets the state
    from the other one."""
    steps = 60
    die = {"op": "send", "after_step": 1, "once": True}
    job = start(train_worker, 4, coordinator.address,
                {"steps": steps, "interval": 0.01, "finishers": 2, "die": {"0": die, "3": die}})
    joiner = None
    try:
        wait_progress(job, 3, 10)
        job.signal(1, signal.SIGKILL)
        time.sleep(0.03)
        job.signal(2, signal.SIGKILL)
        wait_progress(job, 3, 20)
        joiner = start(train_worker, 1, coordinator.address, {"steps": steps, "finishers": 2}, store=job.store)
        joined = joiner.collect(timeout=120)[0]
        deadline = time.monotonic() + 30
        while any(job.procs[r].exitcode is None for r in (0, 3)) and time.monotonic() < deadline:
            time.sleep(0.05)
        sender = [r for r in (0, 3) if job.procs[r].exitcode == -signal.SIGKILL]
        assert len(sender) == 1, "exactly one survivor should have died sending the state"
        other = 3 - sender[0]
        results = {other: job.collect([other], timeout=30)[other], 4: joined}
    finally:
        job.close()
        if joiner is not None:
            joiner.close()
    pids = [r["pid"] for r in results.values()] + [job.pid(r) for r in range(4)]
    assert check_invariant(job.store, pids, steps) >= steps - 1
    assert len({r["final"] for r in results.values()}) == 1
    recovered = [e[2] for e in results[4]["events"] if e[1] == "recovered"]
    assert recovered and recovered[-1]["step"] >= 20, recovered

"""The Manager on a two-channel group (issue 27): the vote, identities, fingerprints and plans on
the CPU channel, gradients, FSDP2's collectives and the state handover on the device channel.

On CPU the device channel is ``gloo-as-nccl`` (real Gloo sockets with NCCL's abort and wait
semantics, ``ftc10d.pg.channels``). The same checks as the one-channel tests: a SIGKILLed rank,
a replacement that receives the state, every committed step one fingerprint; plus each path's
channel (``ftc10d.pg.channels.ISSUED``). ``make test-channels`` runs all of ``tests/train`` in
this mode."""

from __future__ import annotations

import signal

from ftc10d.membership import Coordinator
from tests.harness import start
from tests.train.test_hsdp_manager import _check_shards, _pids, _run
from tests.train.test_manager import check_invariant, wait_progress
from tests.train.workers import train_worker

SPEC = "cpu:gloo,cuda:gloo-as-nccl"


def _both_channels(results: dict) -> None:
    for r, res in results.items():
        used = res["channels"]
        # data: a gradient all-reduce per bucket per step (DDP) or FSDP2's collectives; control:
        # a vote per step, the exchanges at each configuration
        assert used.get("data", 0) > 0 and used.get("control", 0) > 0, (r, used)


def test_ddp_on_two_channels_survives_a_sigkill_and_a_replacement(coordinator: Coordinator) -> None:
    steps = 40
    opts = {"steps": steps, "interval": 0.01, "finishers": 3, "backend": SPEC}
    job = start(train_worker, 3, coordinator.address, opts)
    joiner = None
    try:
        wait_progress(job, 0, 10)
        victim = job.pid(1)
        job.signal(1, signal.SIGKILL)
        wait_progress(job, 0, 18)
        joiner = start(train_worker, 1, coordinator.address, {**opts, "steps": steps}, store=job.store)
        results = job.collect([0, 2], timeout=120)
        results[3] = joiner.collect(timeout=60)[0]
    finally:
        job.close()
        if joiner is not None:
            joiner.close()
    pids = [r["pid"] for r in results.values()] + [victim]
    assert check_invariant(job.store, pids, steps) >= steps - 1
    assert len({r["final"] for r in results.values()}) == 1, "live replicas differ at the end"
    assert all(r["steps"] == steps for r in results.values())
    assert [e for e in results[3]["events"] if e[1] == "recovered"], results[3]["events"]
    _both_channels(results)
    # more data ops than votes: every step's gradients ride the data channel
    assert all(r["channels"]["data"] >= steps // 2 for r in results.values()), results


def test_ft_hsdp_on_two_channels_survives_a_sigkill(coordinator: Coordinator) -> None:
    store, results, victim, waited = _run(coordinator, 1, {"backend": SPEC}, kill=True)
    assert waited <= 1, "the hit replica's survivor committed without its replica"
    _check_shards(store, _pids(results, 1, victim), 8 + 5)
    assert [e for e in results[4]["events"] if e[0] == "recovered"], results[4]["events"]
    _both_channels(results)

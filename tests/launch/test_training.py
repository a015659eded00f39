"""End to end: tests/train/scripts/train_job.py under the launcher, with faults.

Each case checks invariant 1 (every step committed by several replicas has one
state fingerprint, published by the workers under ``test/fp/<step>/<pid>`` in the
launcher's coordinator store) and that training reached its last step, with
every slot's worker exiting 0 (respawned ones included).
"""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch.distributed as dist

from ftc10d.chaos.etcd import ETCD, SKIP_REASON, EtcdCluster
from ftc10d.launch import LaunchConfig, Launcher
from tests.launch.conftest import SCRIPTS, child_env, wait_for

#: tests/train/scripts/train_job.py, with the library's log lines in each worker's log file
TRAIN_JOB = str(SCRIPTS / "train_logged.py")
NPROC = 3


class Run:
    """A launcher running train_job.py, and a client of its store to watch the job."""

    def __init__(self, log_dir: Path, opts: dict[str, Any], *, spares: int = 1, hb: float = 2.0,
                 max_restarts: int = 3, membership_endpoints: Optional[list[str]] = None) -> None:
        # Long enough that a replacement is in well before the end: the survivors of a short job
        # would finish and leave while it joins (it would then train alone, from nothing).
        opts = {"steps": 70, "interval": 0.02, "finishers": NPROC, **opts}
        self.steps = opts["steps"]
        env = {"FTC10D_TEST_OPTS": json.dumps(opts), "PYTHONPATH": child_env()["PYTHONPATH"]}
        self.launcher = Launcher(LaunchConfig(script=TRAIN_JOB, nproc_per_node=NPROC, spares=spares,
                                              heartbeat_timeout=hb, max_restarts=max_restarts, env=env,
                                              log_dir=str(log_dir),
                                              membership_endpoints=membership_endpoints)).start()
        host, _, port = self.launcher.coordinator_address.rpartition(":")
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))

    def progress(self, pid: int) -> int:
        key = f"test/progress/{pid}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def step_now(self, slot: int) -> int:
        pid = self.launcher.pids().get(slot)
        return 0 if pid is None else self.progress(pid)

    def fault_step(self) -> int:
        """When to inject a fault: a few steps from now, and not before step 10 (past the start-up,
        when 2 cores run every worker's and spare's imports and heartbeats may lapse)."""
        return max(10, self.step_now(0) + 3)

    def wait_step(self, slot: int, step: int, timeout: float = 60.0) -> None:
        def reached() -> bool:
            pid = self.launcher.pids().get(slot)
            if self.launcher.returncode is not None:
                raise AssertionError(f"the job ended before slot {slot} reached step {step}")
            return pid is not None and self.progress(pid) >= step

        wait_for(reached, timeout, f"slot {slot} to reach step {step}")

    def wait_spares(self, n: int = 1) -> None:
        """Wait until ``n`` spares are ready, so that the next replacement is a warm one."""
        wait_for(lambda: sum(e.kind == "spare_ready" for e in self.launcher.events) >= n, 60, f"{n} ready spare(s)")

    def all_pids(self) -> list[int]:
        return sorted({e.pid for e in self.launcher.events if e.kind in ("started", "respawned")})

    def result(self, pid: int) -> Optional[dict[str, Any]]:
        key = f"test/result/{pid}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def finish(self, timeout: float = 90.0) -> dict[int, dict[str, Any]]:
        """Wait for the job; check invariant 1 and the end state; return pid -> result of the finishers."""
        assert self.launcher.wait(timeout) == 0, [e for e in self.launcher.events if e.kind != "spare_ready"]
        pids = self.all_pids()
        compared = 0
        for s in range(1, self.steps + 1):
            keys = [f"test/fp/{s}/{p}" for p in pids if self.store.check([f"test/fp/{s}/{p}"])]
            values = set(self.store.multi_get(keys)) if keys else set()
            assert len(values) <= 1, f"replicas differ after committed step {s}: {len(values)} distinct states"
            compared += len(keys) > 1
        assert compared >= self.steps - 1, f"only {compared} steps were committed by several replicas"
        results = {p: r for p in pids if (r := self.result(p)) is not None}
        finishers = [e.pid for e in self.launcher.events if e.kind == "exited" and e.detail["returncode"] == 0]
        assert sorted(results) == sorted(finishers) and len(finishers) == NPROC
        assert all(r["steps"] == self.steps for r in results.values()), "training did not reach its last step"
        assert len({r["final"] for r in results.values()}) == 1, "live replicas differ at the end"
        return results

    def close(self) -> None:
        self.launcher.close()


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[list[Run]]:
    """The test's Run (closed at the end); on a failure, the tail of every worker's stderr is printed."""
    out: list[Run] = []
    yield out
    for r in out:
        r.close()
    for f in sorted(tmp_path.glob("worker*.err")):
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if "socket.cpp" not in ln]
        if lines:
            print(f"--- {f.name}\n" + "\n".join(lines[-40:]))


def _kinds(events: list[list[Any]]) -> list[str]:
    return [e[1] for e in events]


def test_sigkill_one_rank_respawned_from_a_warm_spare_catches_up(runs: list[Run], tmp_path: Path) -> None:
    run = Run(tmp_path, {})
    runs.append(run)
    run.wait_spares()
    at = run.fault_step()
    run.wait_step(0, at)
    victim = run.launcher.kill(1)
    results = run.finish()
    respawned = [e for e in run.launcher.events if e.kind == "respawned"]
    assert [(e.slot, e.detail["warm"]) for e in respawned] == [(1, True)]
    assert any(e.kind == "reported" and e.pid == victim for e in run.launcher.events)
    joiner = results[respawned[0].pid]
    recovered = [e[2] for e in joiner["events"] if e[1] == "recovered"]
    assert recovered and recovered[0]["step"] >= at - 1, recovered


def test_sigstop_past_the_heartbeat_timeout_is_fenced_and_rejoins(runs: list[Run], tmp_path: Path) -> None:
    run = Run(tmp_path, {}, spares=0, hb=0.5)
    runs.append(run)
    run.wait_step(0, 5)
    frozen = run.launcher.kill(2, signal.SIGSTOP)
    try:
        at = run.progress(frozen)
        run.wait_step(0, at + 5)  # the others went on without it
    finally:
        run.launcher.kill(2, signal.SIGCONT)
    results = run.finish()
    assert run.launcher.pids() == {} and frozen in results, "the frozen worker itself finishes, not a replacement"
    kinds = _kinds(results[frozen]["events"])
    assert "fenced" in kinds and "recovered" in kinds, kinds
    assert not any(e.kind == "respawned" for e in run.launcher.events)


def test_two_failures_in_a_row(runs: list[Run], tmp_path: Path) -> None:
    run = Run(tmp_path, {}, spares=2)
    runs.append(run)
    run.wait_spares(2)
    run.wait_step(0, run.fault_step())
    run.launcher.kill(1)
    time.sleep(0.03)
    run.launcher.kill(2)
    run.finish()
    respawned = sorted(e.slot for e in run.launcher.events if e.kind == "respawned")
    assert respawned == [1, 2]


def test_source_dies_while_sending_state_to_the_replacement(runs: list[Run], tmp_path: Path) -> None:
    die = {"op": "send", "after_step": 5, "once": True}
    run = Run(tmp_path, {"die": {"0": die, "2": die}}, spares=2)
    runs.append(run)
    run.wait_spares(2)
    run.wait_step(0, run.fault_step())
    run.launcher.kill(1)
    run.finish()
    exits = [(e.slot, e.detail["signal"]) for e in run.launcher.events if e.kind == "exited"]
    sources = [slot for slot, sig in exits if sig == "SIGKILL" and slot in (0, 2)]
    assert len(sources) == 1, f"exactly one source should have died sending the state: {exits}"
    assert sorted(e.slot for e in run.launcher.events if e.kind == "respawned") == sorted([1, sources[0]])


def test_member_dies_during_the_commit_vote(runs: list[Run], tmp_path: Path) -> None:
    run = Run(tmp_path, {"die": {"2": {"op": "vote", "after_step": 15, "once": True}}})
    runs.append(run)
    results = run.finish()
    exits = [(e.slot, e.detail["signal"]) for e in run.launcher.events if e.kind == "exited"]
    assert (2, "SIGKILL") in exits
    survivors = [r for r in results.values() if r["pid"] in {e.pid for e in run.launcher.events
                                                                if e.kind == "started" and e.slot != 2}]
    assert survivors and all(r["aborted"] >= 1 for r in survivors), "the interrupted step must not be applied"


@pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
def test_membership_in_a_three_member_etcd_cluster_survives_a_sigkilled_rank(runs: list[Run], tmp_path: Path) -> None:
    """``--membership-endpoints``: the workers' membership and the launcher's exit report both go
    to etcd (the coordinator store keeps only the group's rendezvous); a SIGKILLed worker is
    reported there, replaced from the warm spare, and the job trains on to its last step."""
    from ftc10d.membership import Agreement, Signer, TCPMembershipStore

    cluster = EtcdCluster(3, base=str(tmp_path / "etcd")).start()
    try:
        run = Run(tmp_path, {}, membership_endpoints=cluster.endpoints)
        runs.append(run)
        run.wait_spares()
        run.wait_step(0, run.fault_step())
        victim = run.launcher.kill(1)
        run.finish()
        reported = [e for e in run.launcher.events if e.kind == "reported" and e.pid == victim]
        assert reported and reported[0].detail["epoch"] is not None, run.launcher.events
        assert [e.slot for e in run.launcher.events if e.kind == "respawned"] == [1]
        store = run.launcher.membership_store()
        assert store.kind == "etcd" and run.launcher.launch_id in store.prefix
        latest = Agreement(store, Signer(None)).latest()
        assert latest is not None and latest.epoch >= 3, latest  # first config, the kill, the replacement
        host, _, port = run.launcher.coordinator_address.rpartition(":")
        assert Agreement(TCPMembershipStore(host, int(port)), Signer(None)).latest() is None, \
            "membership must not be in the coordinator store"
    finally:
        for r in runs:
            r.close()
        cluster.stop()

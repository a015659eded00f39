"""The headline case: FT-HSDP loses a whole *node* and keeps training without a restart.

Two launchers (``ftc10d launch --nnodes 2 --min-members 2``), one per "node", each running one
replica of a 2x2 FT-HSDP job (the demo's worker, ``--mesh 2x2``: FSDP2 inside each replica). Node 1's
launcher is SIGKILLed: the kernel kills its workers with it (``PR_SET_PDEATHSIG``), and
nobody is left on that node to report their exits; the members' heartbeats find them gone,
and the half left holds the configuration's first member (the membership's tie-breaker).
Checked: node 0's replica trains on alone, its processes never restart; a new launcher for
node 1 starts fresh workers in slots 2 and 3, they receive their shards from the ranks of the
same shard index on node 0, and both replicas finish with every shard bitwise identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ftc10d.membership import Coordinator
from tests.launch.conftest import alive, child_env, wait_for

WORKER = str(Path(__file__).resolve().parents[2] / "src" / "ftc10d" / "demo" / "worker.py")
STEPS = 300
#: Paced so that the new node's cold start (a fresh interpreter importing torch) lands mid-run.
STEP_TIME = 0.05


def _launch(coordinator: Coordinator, node: int, out: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ftc10d", "launch", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "2", "--coordinator", coordinator.address, "--min-members", "2",
           "--heartbeat-timeout", "1", "--max-restarts", "0", "--log-dir", str(out / f"logs-{name}"),
           WORKER, "--out", str(out), "--steps", str(STEPS), "--mesh", "2x2", "--job", "node-loss",
           "--fp-every", "5", "--min-step-time", str(STEP_TIME)]
    return subprocess.Popen(cmd, env=child_env({"OMP_NUM_THREADS": "1"}), start_new_session=True,
                            stdout=open(out / f"{name}.out", "w"), stderr=subprocess.STDOUT)


def _events(out: Path) -> list[dict[str, Any]]:
    from ftc10d.demo.report import load_events

    return load_events(out)


def _committed(out: Path, slots: set[int]) -> int:
    steps = [e["step"] for e in _events(out) if e["kind"] == "step" and e["ok"] and e["slot"] in slots]
    return max(steps, default=0)


def _pids(out: Path, slots: set[int]) -> set[int]:
    return {e["pid"] for e in _events(out) if e["kind"] == "start" and e["slot"] in slots}


def test_a_whole_replica_and_its_launcher_lost_the_other_trains_on_and_a_new_node_gets_the_shards(
        coordinator: Coordinator, tmp_path: Path) -> None:
    node0 = _launch(coordinator, 0, tmp_path, "node0")
    # node 0's ranks join first, so the configuration's first member is on node 0: when node 1
    # goes, the half left holds it and wins the membership's tie-breaker (two halves: no
    # majority either way; see ftc10d.membership.agreement)
    wait_for(lambda: {e["slot"] for e in _events(tmp_path) if e["kind"] == "ready"} >= {0, 1}, 120,
             "node 0's ranks to join")
    node1 = _launch(coordinator, 1, tmp_path, "node1")
    node1b = None
    try:
        wait_for(lambda: _committed(tmp_path, {0, 1, 2, 3}) >= 20, 120, "the job's step 20")
        first = [e["slot"] for e in _events(tmp_path) if e["kind"] == "admitted" and e["rank"] == 0]
        assert first and first[0] in (0, 1), f"the configuration's first member is not on node 0: {first}"
        before = _pids(tmp_path, {0, 1})
        lost = _pids(tmp_path, {2, 3})
        os.killpg(node1.pid, signal.SIGKILL)  # the node: its launcher, and with it its workers
        node1.wait(10)
        wait_for(lambda: not any(alive(p) for p in lost), 10, "node 1's workers to die with their launcher")
        at_loss = _committed(tmp_path, {0, 1})
        # node 0's replica goes on alone, without waiting for a replacement
        wait_for(lambda: _committed(tmp_path, {0, 1}) >= at_loss + 15, 60, "node 0's replica to train on alone")
        alone = _committed(tmp_path, {0, 1})
        assert alone < STEPS - 20, f"the job went too fast for the test: step {alone} of {STEPS} before the new node"
        node1b = _launch(coordinator, 1, tmp_path, "node1b")
        assert node0.wait(180) == 0, (tmp_path / "node0.out").read_text()[-3000:]
        assert node1b.wait(60) == 0, (tmp_path / "node1b.out").read_text()[-3000:]
    finally:
        for p in (node0, node1, node1b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    events = _events(tmp_path)
    assert _pids(tmp_path, {0, 1}) == before, "a process of node 0's replica was restarted"
    new = _pids(tmp_path, {2, 3}) - lost
    assert len(new) == 2, new
    # the new node's ranks received their shards (parameters and optimizer state) from node 0
    got = [e for e in events if e["kind"] == "recovered" and e["pid"] in new]
    assert {e["slot"] for e in got} == {2, 3} and all(e["bytes"] > 100_000 for e in got), got
    assert all(e["step"] >= alone for e in got), got
    # both replicas committed together after the rejoin: steps committed by all four
    by_step: dict[int, set[int]] = defaultdict(set)
    for e in events:
        if e["kind"] == "step" and e["ok"]:
            by_step[e["step"]].add(e["slot"])
    together = [s for s, slots in by_step.items() if slots == {0, 1, 2, 3} and s > alone]
    assert len(together) >= 10, sorted(by_step.items())[-5:]
    # invariant 1 per shard: final hashes and every fingerprint agree per shard index
    finals = [e for e in events if e["kind"] == "final"]
    assert {e["pid"] for e in finals} == before | new, finals
    for shard in (0, 1):
        hashes = {e["hash"] for e in finals if e["shard"] == shard}
        assert len(hashes) == 1, (shard, finals)
    fps: dict[tuple[int, int, int], set[str]] = defaultdict(set)
    for e in events:
        if e["kind"] == "fingerprint":
            fps[(e["step"], e["commit_epoch"], e["shard"])].add(e["fp"])
    assert all(len(v) == 1 for v in fps.values()), {k: v for k, v in fps.items() if len(v) > 1}
    assert sum(1 for (step, _, _) in fps if step > alone) >= 4, sorted(fps)

"""A short fixed-seed chaos run, end to end through ``ftc10d chaos``: real processes under the
launcher, real signals; every invariant check must come back clean.

Seed 6 with 2 trials of 100 steps draws: a SIGSTOP past the heartbeat timeout (removed, fenced,
rejoins); and a SIGKILL, then a survivor that dies as it sends the state to a replacement.
About 2 minutes on 2 busy cores. The long run is documented in docs/reliability.md. Then one
fixed etcd trial (``--membership etcd``): one of three etcd members killed, and a worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftc10d.chaos.etcd import ETCD, SKIP_REASON
from ftc10d.chaos.schedule import draw, trial_seeds

ROOT = Path(__file__).resolve().parents[2]
SEED, TRIALS, STEPS = 781, 2, 100


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _replay(tmp_path: Path, spec: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Run the one trial ``spec`` through ``ftc10d chaos --replay --keep``; it must pass every
    check. Returns the output folder and ``summary.json``."""
    replay = tmp_path / "spec.json"
    replay.write_text(json.dumps(spec))
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "ftc10d", "chaos", "--replay", str(replay), "--out", str(out),
                           "--keep"], env=_env(), capture_output=True, text=True, timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["violations"] == [], proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, summary


def test_the_fixed_seed_run_draws_what_this_test_claims() -> None:
    kinds = {f.kind for s in trial_seeds(SEED, TRIALS) for f in draw(s, steps=STEPS).faults}
    assert {"kill", "die_send", "stop_long", "die_after_vote"} <= kinds


def test_short_fixed_seed_chaos_run_has_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "ftc10d", "chaos", "--trials", str(TRIALS), "--seed", str(SEED),
                           "--steps", str(STEPS), "--out", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=420)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["violations"] == [], proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["trials"] == TRIALS and summary["survived"] == TRIALS
    assert sum(summary["faults_by_kind"].values()) >= 3, summary
    assert all(v is not None for v in summary["worst_stall_s_by_kind"].values()), summary
    # Invariant 2 under the faults: guard tensors of aborted configurations were snapshotted and rechecked.
    assert summary["coverage"].get("guard_snapshots", 0) > 0 and summary["coverage"].get("guard_checks", 0) > 0, \
        summary
    records = sorted((out / "trials").glob("*.json"))
    assert len(records) == TRIALS and all(json.loads(r.read_text())["survived"] for r in records)


def test_the_store_freeze_is_drawn_only_when_weighted() -> None:
    """``store_stop`` came after runs whose seeds are on record: a seed draws what it drew."""
    seeds = trial_seeds(5, 200)
    assert not any(f.kind == "store_stop" for s in seeds for f in draw(s).faults)
    weighted = [f for s in seeds for f in draw(s, weights={"store_stop": 20}).faults if f.kind == "store_stop"]
    assert weighted and all(0.3 <= (f.duration or 0) <= 3.0 for f in weighted)
    assert not any(f.kind == "store_stop" for s in seeds[:50]
                   for f in draw(s, membership="etcd", weights={"store_stop": 20}).faults)


def test_a_store_frozen_past_the_heartbeat_timeout_removes_nobody(tmp_path: Path) -> None:
    """The coordinator store SIGSTOPped for 2.5 s (3.3 heartbeat timeouts): every member's
    store call blocks and nobody can beat. On SIGCONT the job goes on in the same
    configuration: no removal on the silence everyone shared, no respawn, no pause past the
    bound (the freeze plus a timeout plus the usual allowance)."""
    spec = {"seed": 1, "world_size": 3, "steps": 60, "timeout": 150,
            "faults": [{"kind": "store_stop", "slot": 0, "at_step": 12, "duration": 2.5}]}
    out, summary = _replay(tmp_path, spec)
    assert summary["faults_by_kind"] == {"store_stop": 1}, summary
    record = json.loads(next((out / "trials").glob("*.json")).read_text())
    fault = record["faults"][0]
    assert fault["pids"] and fault["t_end"] >= fault["t_fault"] + 2.5, fault  # stopped, then continued
    events = [json.loads(line) for f in (out / "trials").glob("*/events/*.jsonl")
              for line in f.read_text().splitlines()]
    starts = sorted(e["slot"] for e in events if e["kind"] == "start")
    epochs = {e.get("epoch") for e in events if e["kind"] == "reconfigured"}
    assert starts == [0, 1, 2] and epochs == {1}, (starts, epochs)  # nobody respawned, nobody removed
    commits = [e for e in events if e["kind"] == "commit"]
    assert len(commits) == 3 * 60, len(commits)


def test_a_bad_replay_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"seed": 1, "faults": [{"kind": "kill", "slot": 7, "at_step": 10}]}))
    proc = subprocess.run([sys.executable, "-m", "ftc10d", "chaos", "--replay", str(bad), "--out",
                           str(tmp_path / "o")], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "slot 7" in proc.stderr, proc.stderr


@pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
def test_etcd_member_killed_and_a_worker_killed_through_the_runner(tmp_path: Path) -> None:
    """``--membership etcd``: the trial's job keeps its membership in a 3-member etcd cluster;
    one member is SIGKILLed and restarted on its data dir (two keep the quorum), a worker is
    SIGKILLed later. The job must train to its last step with every check clean, and the
    cluster must be gone afterwards (no process, port or data dir left)."""
    spec = {"seed": 1, "membership": "etcd", "world_size": 3, "steps": 45, "timeout": 150,
            "faults": [{"kind": "etcd", "slot": 0, "at_step": 10, "duration": 1.0},
                       {"kind": "kill", "slot": 1, "at_step": 24}]}
    out, summary = _replay(tmp_path, spec)
    assert summary["faults_by_kind"] == {"etcd": 1, "kill": 1}, summary
    assert all(v is not None for v in summary["worst_stall_s_by_kind"].values()), summary
    record = json.loads(next((out / "trials").glob("*.json")).read_text())
    etcd = [f for f in record["faults"] if f["fault"]["kind"] == "etcd"][0]
    assert etcd["pids"] and etcd["t_end"] >= etcd["t_fault"] + 1.0, etcd  # killed, then restarted
    assert record["spec"]["membership"] == "etcd"
    assert not list((out / "trials").glob("*/etcd")), "the trial's etcd data dirs must be removed"


def test_mesh_trial_node_loss_and_a_fault_in_each_replica(tmp_path: Path) -> None:
    """``ftc10d chaos --mesh 2x2`` through a replay file: a whole replica SIGKILLed at once (the
    other trains on, the replacements receive their shards from it), then one rank of each
    replica killed at once (no replica complete until both slots are refilled). Every check
    runs per shard: same fingerprint per committed step, every shard held at the end."""
    # Slow steps (interval 0.12 s): while the node's replacements start (one of them cold, seconds on
    # a busy machine), the other replica trains alone; the second fault waits for the mesh to be whole
    # again and must still find the job short of its end (at 0.03 s per step it once did not).
    spec = {"seed": 1, "world_size": 4, "mesh": [2, 2], "steps": 150, "interval": 0.12, "timeout": 200,
            "faults": [{"kind": "node", "slot": 1, "at_step": 15},
                       {"kind": "double", "slot": 0, "slot2": 3, "kind2": "kill", "at_step": 40}]}
    out, summary = _replay(tmp_path, spec)
    assert summary["faults_by_kind"] == {"double": 1, "node": 1}, summary
    assert summary["coverage"].get("recovered", 0) >= 4, summary  # 2 + 2 replacements received their shards
    record = json.loads(next((out / "trials").glob("*.json")).read_text())
    node = [f for f in record["faults"] if f["fault"]["kind"] == "node"][0]
    assert len(node["pids"]) == 2, node


def test_mesh_trial_the_source_dies_as_it_sends_a_shard(tmp_path: Path) -> None:
    """``--mesh 3x2``: slot 1 (replica 0, shard 1) SIGKILLed; the first rank of a live replica
    that starts sending a shard after it (shard 1 to the replacement, or shard 0 to slot 0,
    behind after waiting for its replica) SIGKILLs itself as it sends; the third replica's
    holder sends it instead. (With two replicas that sender is the only holder: state lost by
    design, so schedules draw this fault only with three or more.)"""
    spec = {"seed": 1, "world_size": 6, "mesh": [3, 2], "steps": 60, "timeout": 150,
            "faults": [{"kind": "die_send", "slot": 1, "at_step": 15}]}
    out, summary = _replay(tmp_path, spec)
    assert summary["coverage"].get("suicides") == 1, summary
    files = (out / "trials").glob("*/events/*.jsonl")
    events = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    died = [e for e in events if e["kind"] == "suicide"]
    # the first sender of a shard after the kill: of shard 1 to slot 1's replacement, or of shard 0
    # to slot 0, which waited while its replica was incomplete and fell behind
    assert died and died[0]["op"] == "send" and died[0]["slot"] in (2, 3, 4, 5), died
    got = [e for e in events if e["kind"] == "recovered" and e["slot"] == 1 and int(e["step"]) >= 15]
    assert got and got[0]["shard"] == 1, got  # the replacement received shard 1 all the same
    after = [e for e in events if e["kind"] == "recovered" and float(e["t"]) > died[0]["t"]]
    assert after, "a rank received its shard after the sender died"


@pytest.mark.parametrize("mesh,resume_s", [(None, 0.3), ([2, 2], 4.0)])
def test_a_stale_member_after_every_holder_died_stops_the_job(tmp_path: Path, mesh: Any, resume_s: float) -> None:
    """The ``stale`` fault (invariant 8): slot 3 frozen past the heartbeat; the others commit 5
    steps without it; every holder of that newer state (DDP: every other slot; 2x2: replica 0)
    SIGKILLed at once; slot 3 resumed 0.3 s later (before the replacements) or 4 s later (after).
    The job must stop with StateLostError (launcher exit 86), no step committed twice."""
    spec = {"seed": 1, "world_size": 4, "steps": 100, "timeout": 150,
            "faults": [{"kind": "stale", "slot": 3, "at_step": 20, "duration": resume_s}],
            **({"mesh": mesh} if mesh else {})}
    out, summary = _replay(tmp_path, spec)
    assert summary["faults_by_kind"] == {"stale": 1}, summary
    files = (out / "trials").glob("*/events/*.jsonl")
    events = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    lost = [e for e in events if e["kind"] == "state_lost_exit"]
    assert lost and all("the job committed step" in e["error"] for e in lost), lost
    record = json.loads(next((out / "trials").glob("*.json")).read_text())
    assert record["returncode"] == 86, record["returncode"]

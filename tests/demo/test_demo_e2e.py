"""One real `ftc10d demo --no-live` run in short mode: 4 workers, a kill, a freeze, a warm join."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
def test_demo_short_run_recovers_and_replicas_agree(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "ftc10d", "demo", "--no-live", "--out", str(out), "--steps", "100",
         "--faults", "kill:1@15,freeze:2@40:1.2", "--heartbeat-timeout", "0.5", "--timeout", "120",
         "--max-pause", "20"],  # behaviour, not timing: a bound a loaded CI machine cannot miss
        env=env, capture_output=True, text=True, timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replicas bitwise-identical: yes" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 4 and report["steps"] == 100
    assert report["completed"] is True
    assert report["replicas_identical"] is True
    assert report["fingerprint_checks"]["checked_steps"] >= 5
    assert report["step_time_median_s"] > 0
    # The job's longest pause is a figure of its own, checked against --max-pause.
    assert report["longest_pause_bound_s"] == 20.0 and report["longest_pause_ok"] is True
    assert 0 < report["longest_pause_s"] <= 20.0 and report["longest_pause"]["to_step"] > 0
    assert "longest pause between commits:" in proc.stdout
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds.count("kill") == 1 and kinds.count("freeze") == 1 and kinds.count("join") >= 1
    for f in report["faults"]:
        assert f["recovered"], f
        assert f["stall_s"] is not None and f["t_recovered"] > f["t_fault"]
    freeze = next(f for f in report["faults"] if f["kind"] == "freeze")
    assert freeze["removed"] and freeze["rejoined"], freeze
    join = next(f for f in report["faults"] if f["kind"] == "join")
    assert join["warm"] and join["received_state"], join
    assert report["loss_last"] < report["loss_first"] / 5
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(150)
def test_demo_mesh_2x2_recovers_per_shard(tmp_path: Path) -> None:
    """`ftc10d demo --mesh 2x2`: FT-HSDP, a kill and a freeze; every shard index's replicas agree."""
    out = tmp_path / "out"
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "ftc10d", "demo", "--mesh", "2x2", "--no-live", "--out", str(out), "--steps", "100",
         "--faults", "kill:1@15,freeze:2@40:1.2", "--heartbeat-timeout", "0.5", "--timeout", "120",
         "--max-pause", "20"],
        env=env, capture_output=True, text=True, timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FT-HSDP 2x2" in proc.stdout and "distinct per shard index: shard 0: 1, shard 1: 1" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] is True and report["replicas_identical"] is True
    assert set(report["final_hashes_by_shard"]) == {"0", "1"}, report["final_hashes_by_shard"]
    assert len(report["final_hashes"]) == 2  # the two shards differ; each agrees across its replicas
    assert report["fingerprint_checks"]["checked_steps"] >= 10
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds.count("kill") == 1 and kinds.count("freeze") == 1 and kinds.count("join") >= 1
    for f in report["faults"]:
        assert f["recovered"], f
    join = next(f for f in report["faults"] if f["kind"] == "join")
    assert join["received_state"], join
    assert report["loss_last"] < report["loss_first"] / 5

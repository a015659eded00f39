"""report.json and timeline.png built from synthetic event files (no job runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftc10d.demo.report import build_report, read_jsonl

T0 = 1_000_000.0
DT = 0.05


def write(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def steps(pid: int, slot: int, first: int, last: int, t: float, epoch: int, world: int,
          fp: str = "aa") -> list[dict[str, Any]]:
    out = []
    for s in range(first, last + 1):
        out.append({"t": t, "kind": "step", "pid": pid, "slot": slot, "step": s, "ok": True, "loss": 1.0 / s,
                    "epoch": epoch, "world_size": world, "rank": slot, "dt": DT})
        if s % 5 == 0:
            out.append({"t": t, "kind": "fingerprint", "pid": pid, "slot": slot, "step": s, "fp": f"{fp}{s}"})
        t += DT
    return out


def synthetic_run(tmp: Path, *, diverge: bool = False) -> Path:
    """Slots 0, 1, 2 train steps 1..10 (epoch 1); slot 1 is killed at t(10) + 0.01; the survivors
    lose one attempt and commit step 11 in epoch 2 0.2 s later; a warm replacement (pid 13)
    joins 0.1 s after the kill and commits step 12 (epoch 3); everyone finishes at 20."""
    ev = tmp / "events"
    for pid, slot in ((10, 0), (11, 1), (12, 2)):
        write(ev / f"{slot}-{pid}.jsonl", [{"t": T0 - 1, "kind": "start", "pid": pid, "slot": slot}]
              + steps(pid, slot, 1, 10, T0, 1, 3))
    t_kill = T0 + 10 * DT
    for pid, slot in ((10, 0), (12, 2)):
        write(ev / f"{slot}-{pid}.jsonl", [
            {"t": t_kill + 0.05, "kind": "step", "pid": pid, "slot": slot, "step": 10, "ok": False, "loss": 0.1,
             "epoch": 1, "world_size": 3, "rank": slot, "dt": DT},
            {"t": t_kill + 0.1, "kind": "reconfigured", "pid": pid, "slot": slot, "epoch": 2},
        ] + steps(pid, slot, 11, 11, t_kill + 0.2, 2, 2))
        fp = "bb" if diverge and pid == 12 else "aa"
        write(ev / f"{slot}-{pid}.jsonl", steps(pid, slot, 12, 20, t_kill + 0.5, 3, 3, fp=fp)
              + [{"t": t_kill + 2, "kind": "final", "pid": pid, "slot": slot, "step": 20, "hash": fp}])
    write(ev / "1-13.jsonl", [{"t": t_kill + 0.1, "kind": "start", "pid": 13, "slot": 1},
                              {"t": t_kill + 0.4, "kind": "recovered", "pid": 13, "slot": 1, "step": 11}]
          + steps(13, 1, 12, 20, t_kill + 0.5, 3, 3)
          + [{"t": t_kill + 2, "kind": "final", "pid": 13, "slot": 1, "step": 20, "hash": "aa"}])
    write(tmp / "faults.jsonl", [{"kind": "kill", "slot": 1, "pid": 11, "at_step": 10, "t_fault": t_kill,
                                  "duration": None}])
    write(tmp / "launcher.jsonl", [{"kind": "exited", "slot": 1, "pid": 11, "time": t_kill + 0.01,
                                    "detail": {"returncode": -9, "signal": "SIGKILL"}},
                                   {"kind": "respawned", "slot": 1, "pid": 13, "time": t_kill + 0.1,
                                    "detail": {"warm": True, "restart": 1}}])
    return tmp


def test_report_fields_from_synthetic_events(tmp_path: Path) -> None:
    r = build_report(synthetic_run(tmp_path), world_size=3, steps=20, launcher_returncode=0)
    assert r["world_size"] == 3 and r["steps"] == 20
    assert r["completed"] is True
    assert r["replicas_identical"] is True
    assert r["fingerprint_checks"]["checked_steps"] == 4  # 5, 10, 15, 20 seen by more than one rank
    assert r["step_time_median_s"] == pytest.approx(DT, rel=0.01)
    kill, join = r["faults"]
    assert kill["kind"] == "kill" and kill["rank"] == 1 and kill["at_step"] == 10
    assert kill["t_recovered"] == pytest.approx(T0 + 10 * DT + 0.2)
    assert kill["stall_s"] == pytest.approx(0.2, abs=1e-3)
    assert kill["steps_lost"] == 1
    assert join["kind"] == "join" and join["warm"] is True and join["received_state"] is True
    assert join["since_kill_s"] == pytest.approx(0.5, abs=1e-3)
    assert join["first_commit_s"] == pytest.approx(0.4, abs=1e-3)
    for f in r["faults"]:
        assert {"kind", "rank", "at_step", "t_fault", "t_recovered", "stall_s", "steps_lost"} <= set(f)


def test_diverging_replicas_are_reported(tmp_path: Path) -> None:
    r = build_report(synthetic_run(tmp_path, diverge=True), world_size=3, steps=20)
    assert r["replicas_identical"] is False
    assert r["fingerprint_checks"]["disagreeing_steps"] == [15, 20]


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"a": 2')
    assert read_jsonl(p) == [{"a": 1}]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from ftc10d.demo.plot import plot_timeline

    out = synthetic_run(tmp_path)
    png = plot_timeline(out, build_report(out, world_size=3, steps=20))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000


def test_the_longest_pause_is_the_longest_gap_between_job_commits_whatever_its_cause(tmp_path: Path) -> None:
    """Step 10 at 0.45 s, the kill at 0.5 s, step 11 at 0.7 s (a gap of 0.25 s), step 12 at 1.0 s:
    the longest gap is 11 -> 12 (0.3 s, while the replacement received its state), and the
    report says when and what happened in it."""
    report = build_report(synthetic_run(tmp_path), world_size=3, steps=20)
    pause = report["longest_pause"]
    assert report["longest_pause_s"] == pytest.approx(0.3, abs=1e-3)
    assert (pause["after_step"], pause["to_step"]) == (11, 12)
    assert "recovered" in pause["events"], pause

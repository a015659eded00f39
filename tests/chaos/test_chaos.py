"""A short fixed-seed chaos run, end to end through ``ftc10d chaos``: real processes under the
launcher, real signals; every invariant check must come back clean.

Seed 6 with 2 trials of 100 steps draws: a SIGSTOP past the heartbeat timeout (removed, fenced,
rejoins); and a SIGKILL, then a survivor that dies as it sends the state to a replacement.
About 2 minutes on 2 busy cores. The long run is documented in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ftc10d.chaos.schedule import draw, trial_seeds

ROOT = Path(__file__).resolve().parents[2]
SEED, TRIALS, STEPS = 6, 2, 100


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_the_fixed_seed_run_draws_what_this_test_claims() -> None:
    kinds = {f.kind for s in trial_seeds(SEED, TRIALS) for f in draw(s, steps=STEPS).faults}
    assert {"kill", "die_send", "stop_long"} <= kinds


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


def test_a_bad_replay_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"seed": 1, "faults": [{"kind": "kill", "slot": 7, "at_step": 10}]}))
    proc = subprocess.run([sys.executable, "-m", "ftc10d", "chaos", "--replay", str(bad), "--out",
                           str(tmp_path / "o")], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "slot 7" in proc.stderr, proc.stderr

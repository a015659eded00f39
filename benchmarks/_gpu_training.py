"""The training part of ``make gpu-check`` (issue 27): the demo's DDP job and its 2x2 FT-HSDP job
under ``ftc10d launch`` on a two-channel group (``cpu:gloo,cuda:nccl``), the model on the GPU,
a rank SIGKILLed and one frozen past the heartbeat; each job's own report says whether it
completed, whether the replicas ended identical, and its longest pause between two commits.

On CPU the same script runs with ``--backend cpu:gloo,cuda:gloo-as-nccl --device cpu`` (Gloo
standing in for NCCL): that proves the script, not the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: (name, demo arguments): a rank SIGKILLed at step 40, another frozen 2.5 s (past the 1-s
#: heartbeat timeout: fenced, it comes back with the committed state) at step 100.
JOBS = (
    ("DDP, 3 ranks", ["--world-size", "3"]),
    ("FT-HSDP 2x2", ["--mesh", "2x2"]),
)
FAULTS = "kill:1@40,freeze:2@100:2.5"
#: The longest pause between two commits a job may have and pass: generous (a safety bound, the
#: figure itself is reported); a frozen FT-HSDP rank stops its replica until it is fenced.
MAX_PAUSE_S = 5.0


def run_jobs(backend: str, device: str, steps: int = 160, timeout: float = 150.0) -> tuple[list[list[Any]], bool]:
    """Rows for gpu-check's table, and whether any job failed."""
    rows: list[list[Any]] = []
    failed = False
    root = tempfile.mkdtemp(prefix="ftc10d-gpu-training-")
    env = dict(os.environ, FTC10D_BACKEND=backend, FTC10D_DEMO_DEVICE=device)
    for name, extra in JOBS:
        out = os.path.join(root, name.split(",")[0].replace(" ", "-"))
        cmd = [sys.executable, "-m", "ftc10d", "demo", "--out", out, "--steps", str(steps), "--faults", FAULTS,
               "--heartbeat-timeout", "1", "--max-pause", str(MAX_PAUSE_S), *extra]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout)
            code, tail = proc.returncode, proc.stdout[-600:]
        except subprocess.TimeoutExpired as exc:
            code, tail = -1, f"timed out after {timeout:.0f} s; {(exc.stdout or '')[-400:]}"
        took = time.monotonic() - t0
        try:
            with open(os.path.join(out, "report.json")) as f:
                report = json.load(f)
        except (OSError, ValueError):
            report = {}
        ok = code == 0 and report.get("completed") and report.get("replicas_identical")
        failed |= not ok
        faults = {f.get("kind"): f.get("first_commit_s") for f in report.get("faults", []) if isinstance(f, dict)}
        detail = (f"longest pause {report.get('longest_pause_s')} s; identical {report.get('replicas_identical')}; "
                  f"first commit after kill {faults.get('kill')} s, after freeze {faults.get('freeze')} s")
        rows.append([f"{name} on {backend} ({device}): kill + freeze", "PASS" if ok else f"FAIL (exit {code}): "
                     + " ".join(tail.split())[-200:], f"{detail}; {took:.0f} s"])
    return rows, failed


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu:gloo,cuda:nccl")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    table, bad = run_jobs(args.backend, args.device)
    for row in table:
        print(" | ".join(str(x) for x in row))
    sys.exit(1 if bad else 0)

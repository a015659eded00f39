"""The default demo, N times in a row: are the replicas identical every time, and does the
demo's exit status say so?

Issue 18's evidence: one run in 24 of `ftc10d demo` (SIGKILL of slot 1 at step 40, a
freeze of slot 2 at step 120) once ended with one replica diverged. Each run here is a
fresh `ftc10d demo --no-live` (4 workers, a warm spare, the default fault schedule); from
its report.json this records whether the job completed, whether the replicas ended
bitwise-identical (final state_hash on every live rank, and the fingerprints compared
every 10 steps), the exit status, and the stall of each fault. A run whose replicas
differ but whose exit status is 0 is reported as a lie (the demo must never say yes then).

Issue 14's evidence too: each run's longest pause between two commits against the demo's
bound (heartbeat timeout + 1 s), and the lines of torch's store-timeout warnings in the
workers' logs (waiting is normal operation: there should be none).

Usage: ``python benchmarks/demo_repeat.py [--runs 50] [--out bench-out/demo-repeat]``
(takes ~45 s a run on 2 cores). Prints one line per run and a summary; writes
``summary.json`` in --out. Exit status 0 iff every run completed with identical replicas,
within its pause bound, and every exit status told the truth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def store_timeout_warnings(out: Path) -> int:
    """Lines of torch's "waitForInput ... timed out" warnings in the run's worker logs:
    waiting is normal operation and must not print them (issue 14)."""
    n = 0
    for f in (out / "logs").glob("*.err"):
        n += sum("waitForInput" in line for line in f.read_text(errors="replace").splitlines())
    return n


def one_run(out: Path, timeout: float) -> dict[str, Any]:
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "ftc10d", "demo", "--no-live", "--out", str(out)],
                              capture_output=True, text=True, timeout=timeout)
        rc: Any = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rec: dict[str, Any] = {"out": str(out), "rc": rc, "seconds": round(time.time() - t0, 1)}
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError) as exc:
        rec.update(completed=False, identical=False, error=f"no report.json: {exc}")
        return rec
    fps = report.get("fingerprint_checks", {})
    rec.update(
        completed=bool(report.get("completed")),
        identical=bool(report.get("replicas_identical")),
        final_hashes=len(report.get("final_hashes", [])),
        final_ranks=report.get("final_ranks"),
        checked_steps=fps.get("checked_steps"),
        disagreeing_steps=fps.get("disagreeing_steps"),
        stalls_s=[(f["kind"], f.get("stall_s")) for f in report.get("faults", [])],
        longest_pause_s=report.get("longest_pause_s"),
        pause_ok=report.get("longest_pause_ok"),
        store_timeout_warnings=store_timeout_warnings(out),
    )
    rec["lie"] = rc == 0 and not (rec["completed"] and rec["identical"])
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", default="bench-out/demo-repeat")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of one run (s)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(1, args.runs + 1):
        rec = one_run(out / f"run-{k:03d}", args.timeout)
        runs.append(rec)
        print(f"run {k:3d}: rc={rec['rc']} completed={rec['completed']} identical={rec['identical']} "
              f"hashes={rec.get('final_hashes')} fp-checked={rec.get('checked_steps')} "
              f"disagreeing={rec.get('disagreeing_steps')} stalls={rec.get('stalls_s')} "
              f"longest pause={rec.get('longest_pause_s')} s, store-timeout warnings="
              f"{rec.get('store_timeout_warnings')}, run {rec['seconds']} s"
              + ("  <-- EXIT 0 BUT NOT IDENTICAL" if rec["lie"] else ""), flush=True)
        (out / "summary.json").write_text(json.dumps({"runs": runs}, indent=1))
    good = [r for r in runs if r["completed"] and r["identical"]]
    lies = [r for r in runs if r["lie"]]
    honest = [r for r in runs if r["rc"] != 0 and not (r["completed"] and r["identical"])]
    summary = {
        "command": "python benchmarks/demo_repeat.py " + " ".join(sys.argv[1:]),
        "runs": len(runs), "identical": len(good), "not_identical_or_incomplete": len(runs) - len(good),
        "exit_0_but_not_identical": len(lies), "nonzero_exit_when_not_identical": len(honest),
        "median_run_s": statistics.median(r["seconds"] for r in runs) if runs else None,
        "longest_pause_s": max((r.get("longest_pause_s") or 0.0 for r in runs), default=None),
        "pause_over_bound": sum(r.get("pause_ok") is False for r in runs),
        "store_timeout_warnings": sum(r.get("store_timeout_warnings") or 0 for r in runs),
        "runs_detail": runs,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{len(good)}/{len(runs)} runs completed with bitwise-identical replicas; "
          f"{len(lies)} exited 0 while not identical; {len(honest)} failed runs exited non-zero "
          f"(median run {summary['median_run_s']} s); the job's longest pause over all runs: "
          f"{summary['longest_pause_s']} s; {summary['pause_over_bound']} run(s) over the demo's pause bound; "
          f"{summary['store_timeout_warnings']} store-timeout warning line(s) in the workers' logs")
    return 0 if len(good) == len(runs) and not lies and not summary["pause_over_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())

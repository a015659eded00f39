"""``ftc10d chaos``: run N randomized trials (or replay one) and summarize.

Trial ``k`` of a run with seed ``S`` has seed ``trial_seeds(S, N)[k]``, and its schedule
is drawn from that seed alone, so a run is reproducible trial by trial. Each trial's
record goes to ``<out>/trials/<k>-<seed>.json`` (pass that file to ``--replay``), and
``<out>/summary.json`` holds: ``trials``, ``survived``, ``violations`` (seed, schedule,
what broke, the replay file), ``faults_by_kind``, ``worst_stall_s_by_kind`` and the
command line to run it again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from ftc10d.chaos import netns
from ftc10d.chaos.schedule import TrialSpec, available_kinds, draw, load_replay, mesh_kinds, trial_seeds
from ftc10d.chaos.trial import TrialResult, run_trial


def summarize(results: list[TrialResult], command: str) -> dict[str, Any]:
    """The ``summary.json`` of a run."""
    by_kind: Counter[str] = Counter()
    worst: dict[str, float] = {}
    skipped: Counter[str] = Counter()
    for r in results:
        for inj in r.injected:
            kind = inj.fault.kind
            if inj.skipped:
                skipped[kind] += 1
                continue
            by_kind[kind] += 1
            if inj.stall_s is not None:
                worst[kind] = max(worst.get(kind, 0.0), inj.stall_s)
    violations = [{"seed": r.spec.seed, "schedule": r.spec.describe(), "violations": r.violations,
                   "replay": str(Path(r.folder).with_suffix(".json")) if r.folder else None} for r in results
                  if r.violations]
    return {
        "trials": len(results),
        "survived": sum(r.survived for r in results),
        "violations": violations,
        "faults_by_kind": dict(sorted(by_kind.items())),
        "faults_skipped_by_kind": dict(sorted(skipped.items())),
        "worst_stall_s_by_kind": {k: (round(v, 3) if math.isfinite(v) else None) for k, v in sorted(worst.items())},
        "longest_pause_s": max((r.longest_pause_s or 0.0 for r in results), default=None),
        "longest_pause_s_by_trial": [r.longest_pause_s for r in results],
        "pause_bound_s_by_trial": [r.pause_bound_s for r in results],
        "pauses_over_bound": sum(1 for r in results if r.longest_pause_s is not None and r.pause_bound_s is not None
                                 and r.longest_pause_s > r.pause_bound_s),
        "coverage": dict(sum((Counter(r.coverage) for r in results), Counter())),
        "trial_seconds": [round(r.duration_s, 1) for r in results],
        "command": command,
    }


def _print_result(k: int, n: int, r: TrialResult) -> None:
    stalls = ", ".join(f"{i.fault.kind} {i.stall_s:.2f}s" if i.stall_s is not None and math.isfinite(i.stall_s)
                       else f"{i.fault.kind} skipped ({i.skipped})" if i.skipped else f"{i.fault.kind} ∞"
                       for i in r.injected)
    verdict = "survived" if r.survived else "VIOLATION"
    pause = "-" if r.longest_pause_s is None else f"{r.longest_pause_s:.2f}s (bound {r.pause_bound_s:g}s)"
    print(f"trial {k + 1}/{n} seed {r.spec.seed}: {verdict} in {r.duration_s:.1f}s; stall: {stalls or '-'}; "
          f"longest pause {pause}", flush=True)
    if not r.survived:
        print(f"  schedule: {r.spec.describe()}", flush=True)
        for v in r.violations:
            print(f"  broke: {v}", flush=True)
        print(f"  replay: ftc10d chaos --replay {Path(r.folder).with_suffix('.json')}", flush=True)


def run(*, trials: int, seed: int, out: str, replay: Optional[str] = None, hosts: int = 1, world_size: int = 4,
        steps: int = 150, heartbeat_timeout: float = 0.75, keep: bool = False, command: str = "",
        membership: str = "tcp", weights: Optional[dict[str, int]] = None, mesh: Optional[list[int]] = None) -> int:
    """Run the trials; returns 0 iff every trial survived. ``membership``: ``tcp`` (the
    coordinator store) or ``etcd`` (each trial starts a 3-member cluster; adds the ``etcd`` fault)."""
    out_dir = Path(out)
    (out_dir / "trials").mkdir(parents=True, exist_ok=True)
    if replay is not None:
        specs = [load_replay(replay)]
    else:
        ok, why = netns.available()
        if hosts > 1 and not ok:
            print(f"ftc10d chaos: --hosts {hosts} ignored: {why}; running on one host", file=sys.stderr)
            hosts = 1
        kinds = available_kinds(hosts, ok, membership) if mesh is None else mesh_kinds(mesh[0], membership)
        specs = [draw(s, world_size=world_size, steps=steps, heartbeat_timeout=heartbeat_timeout, hosts=hosts,
                      kinds=kinds, membership=membership, weights=weights, mesh=mesh)
                 for s in trial_seeds(seed, trials)]
    first = specs[0]
    shape = f"{first.mesh[0]}x{first.mesh[1]} FT-HSDP mesh, " if first.mesh else ""
    print(f"ftc10d chaos: {len(specs)} trial(s), {shape}{first.world_size} workers + {first.spares} warm spare(s), "
          f"{first.steps} steps, heartbeat timeout {first.heartbeat_timeout:g} s, {first.hosts} host(s), "
          f"membership {'3-member etcd' if first.membership == 'etcd' else 'coordinator store'}, "
          f"groups {os.environ.get('FTC10D_BACKEND') or 'gloo'}, out {out_dir}",
          flush=True)
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return _run_specs(specs, out_dir, keep, command)
    # Ctrl-C and SIGTERM (a scheduler's stop, `timeout`) end the run the same way: the
    # first raises RunInterrupted, and the trial's cleanup then runs to its end (further
    # signals are ignored: an interrupted cleanup would leave root-owned namespaces and
    # the coordinator's process behind; SIGKILL still stops the run at once).
    global _interrupted
    _interrupted = False
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_specs(specs, out_dir, keep, command)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class RunInterrupted(KeyboardInterrupt):
    """A chaos run stopped by a signal (``signum``), after the trial in progress was cleaned up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


_interrupted = False


def _interrupt(signum: int, frame: Optional[FrameType]) -> None:
    global _interrupted
    if _interrupted:
        os.write(2, b"ftc10d chaos: still cleaning up the trial (SIGKILL stops at once, leaving its network "
                    b"namespaces and processes behind)\n")
        return
    _interrupted = True
    raise RunInterrupted(signum)


def _write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    tmp = out_dir / "summary.json.tmp"  # whole or not at all, however the run ends
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out_dir / "summary.json")


def _run_specs(specs: list[TrialSpec], out_dir: Path, keep: bool, command: str) -> int:
    results: list[TrialResult] = []
    t0 = time.time()
    _write_summary(out_dir, summarize(results, command))  # not an older run's, if this one is stopped early
    for k, spec in enumerate(specs):
        print(f"trial {k + 1}/{len(specs)} seed {spec.seed}: {spec.describe()}", flush=True)
        folder = out_dir / "trials" / f"{k}-{spec.seed}"
        if folder.exists():
            shutil.rmtree(folder)
        result = run_trial(spec, folder, lambda s: print(s, flush=True))
        folder.with_suffix(".json").write_text(json.dumps(result.to_json(), indent=1, default=str))
        results.append(result)
        _print_result(k, len(specs), result)
        if result.survived and not keep:
            shutil.rmtree(folder, ignore_errors=True)  # the record (.json) stays; the logs of failures too
        _write_summary(out_dir, summarize(results, command))
    summary = summarize(results, command)
    print(f"ftc10d chaos: {summary['survived']}/{summary['trials']} trials survived in {time.time() - t0:.0f} s; "
          f"faults {summary['faults_by_kind']}; worst stall {summary['worst_stall_s_by_kind']}; "
          f"exercised {summary['coverage']}; "
          f"summary {out_dir / 'summary.json'}", flush=True)
    return 0 if summary["survived"] == summary["trials"] else 1


"""``report.json`` from the files a demo run leaves in its out dir.

Inputs (all JSON lines): ``events/<slot>-<pid>.jsonl`` (written by the workers,
see :mod:`ftc10d.demo.worker`), ``faults.jsonl`` (what the driver injected:
``{kind, slot, pid, at_step, t_fault, duration, t_resumed}``) and
``launcher.jsonl`` (the launcher's events). Nothing here needs a running job,
so the tests build reports from synthetic files.

Definitions (also in docs/architecture.md):

- the job *commits* step ``s`` at the earliest time a worker logged step ``s`` committed;
- a kill's or freeze's ``t_recovered`` is the time by which every survivor committed
  a step in a configuration newer than the one of the fault (a freeze shorter than
  the heartbeat timeout removes nobody: then it is the survivors' first commit after it);
- a join's ``t_fault`` is when the launcher handed the slot to the replacement
  (``t_kill`` is the kill it replaces) and ``t_recovered`` the replacement's first commit;
- ``stall_s`` is the longest time without any committed step between ``t_fault``
  and ``t_recovered``; ``steps_lost`` the most step attempts a survivor threw away
  (not committed) in that window;
- ``longest_pause_s`` (and ``longest_pause``: between which steps, when, and the faults and
  Manager events inside it) is the longest interval between consecutive job commits, whatever
  its cause: the figure no per-fault window can miss;
- ``step_time_median_s`` is the median interval between consecutive job commits,
  leaving out the first steps (warm-up) and every fault window (plus one second).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

WARMUP_STEPS = 5


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of ``path`` (a torn last line, from a killed writer, is skipped)."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_events(out_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for f in sorted((Path(out_dir) / "events").glob("*.jsonl")):
        events.extend(read_jsonl(f))
    events.sort(key=lambda e: e["t"])
    return events


class Run:
    """The events of one run, indexed the ways the report needs them."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.events = sorted(events, key=lambda e: e["t"])
        self.by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in self.events:
            self.by_pid[e["pid"]].append(e)
        self.steps = [e for e in self.events if e["kind"] == "step"]
        self.commits: dict[int, float] = {}
        self.losses: dict[int, list[float]] = defaultdict(list)
        for e in self.steps:
            if e["ok"]:
                s = e["step"]
                self.commits[s] = min(self.commits.get(s, e["t"]), e["t"])
                self.losses[s].append(e["loss"])
        starts = [e["t"] for e in self.events if e["kind"] == "start"]
        self.t0 = min(starts) if starts else (self.events[0]["t"] if self.events else 0.0)

    def commit_times(self) -> list[tuple[int, float]]:
        return sorted(self.commits.items())

    def loss_curve(self) -> list[tuple[float, float]]:
        """(time since start, mean loss over the ranks) per committed step."""
        return [(self.commits[s] - self.t0, statistics.fmean(v)) for s, v in sorted(self.losses.items())]

    def step_at(self, t: float) -> int:
        done = [s for s, ct in self.commits.items() if ct <= t]
        return max(done) if done else 0

    def epoch_at(self, t: float) -> int:
        eps = [e["epoch"] for e in self.steps if e["t"] <= t]
        return max(eps) if eps else 0

    def stepping_pids(self, before: float) -> set[int]:
        return {e["pid"] for e in self.steps if e["t"] <= before}

    def first_commit(self, pid: int, after: float, min_epoch: int = -1) -> Optional[float]:
        for e in self.by_pid.get(pid, []):
            if e["kind"] == "step" and e["ok"] and e["t"] > after and e["epoch"] >= min_epoch:
                return e["t"]
        return None

    def has(self, pid: int, kind: str, after: float = 0.0) -> bool:
        return any(e["kind"] == kind and e["t"] > after for e in self.by_pid.get(pid, []))

    def stall(self, start: float, end: float) -> float:
        points = [start] + sorted(t for t in self.commits.values() if start < t <= end) + [end]
        return max(b - a for a, b in zip(points, points[1:])) if len(points) > 1 else 0.0

    def lost(self, pids: Iterable[int], start: float, end: float) -> int:
        counts = [sum(1 for e in self.by_pid.get(p, [])
                      if e["kind"] == "step" and not e["ok"] and start < e["t"] <= end) for p in pids]
        return max(counts, default=0)


def _fault_entry(run: Run, f: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    kind, victim, t_fault = f["kind"], f["pid"], f["t_fault"]
    survivors = {p for p in run.stepping_pids(t_fault) if p != victim and not _dead_before(run, p, t_fault, others)}
    e0 = run.epoch_at(t_fault)
    removed = kind == "kill" or run.has(victim, "fenced", t_fault)
    firsts = [run.first_commit(p, t_fault, e0 + 1 if removed else -1) for p in survivors]
    firsts_known = [t for t in firsts if t is not None]
    t_rec = max(firsts_known) if firsts_known and len(firsts_known) == len(firsts) else None
    entry: dict[str, Any] = {
        "kind": kind, "rank": f["slot"], "pid": victim, "at_step": f.get("at_step", run.step_at(t_fault)),
        "t_fault": t_fault, "t_recovered": t_rec,
        "stall_s": None if t_rec is None else round(run.stall(t_fault, t_rec), 4),
        "steps_lost": None if t_rec is None else run.lost(survivors, t_fault, t_rec),
        "recovered": t_rec is not None,
        "survivors": len(survivors),
        "first_commit_s": None if t_rec is None else round(t_rec - t_fault, 4),
    }
    if kind == "freeze":
        entry["duration_s"] = f.get("duration")
        entry["t_resumed"] = f.get("t_resumed")
        entry["removed"] = removed
        if f.get("t_resumed") is not None:
            back = run.first_commit(victim, f["t_resumed"])
            entry["t_rejoined"] = back
            entry["rejoined"] = back is not None
    return entry


def _dead_before(run: Run, pid: int, t: float, faults: list[dict[str, Any]]) -> bool:
    return any(f["kind"] == "kill" and f["pid"] == pid and f["t_fault"] <= t for f in faults)


def _join_entry(run: Run, ev: dict[str, Any], faults: list[dict[str, Any]]) -> dict[str, Any]:
    pid, slot, t_join = ev["pid"], ev["slot"], ev["time"]
    kills = [f for f in faults if f["kind"] == "kill" and f["slot"] == slot and f["t_fault"] <= t_join]
    t_kill = kills[-1]["t_fault"] if kills else None
    t_rec = run.first_commit(pid, t_join)
    survivors = {p for p in run.stepping_pids(t_join) if p != pid and not _dead_before(run, p, t_join, faults)}
    return {
        "kind": "join", "rank": slot, "pid": pid, "at_step": run.step_at(t_join), "t_fault": t_join,
        "t_recovered": t_rec,
        "stall_s": None if t_rec is None else round(run.stall(t_join, t_rec), 4),
        "steps_lost": None if t_rec is None else run.lost(survivors, t_join, t_rec),
        "recovered": t_rec is not None,
        "warm": bool(ev.get("detail", {}).get("warm")),
        "t_kill": t_kill,
        "first_commit_s": None if t_rec is None else round(t_rec - t_join, 4),
        "since_kill_s": None if t_rec is None or t_kill is None else round(t_rec - t_kill, 4),
        "received_state": run.has(pid, "recovered", t_join),
        "too_late": run.has(pid, "left", t_join),  # the job finished before it could join
    }


def longest_pause(run: Run, faults: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The job's longest interval between two consecutive committed steps, whatever its cause,
    with what happened in it (the faults whose window overlaps it, the Manager's events): the
    pause a user feels, which per-fault stall windows can miss (a rejoin long after its fault)."""
    commits = run.commit_times()
    gaps = [(t1 - t0, s0, s1, t0, t1) for (s0, t0), (s1, t1) in zip(commits, commits[1:])]
    if not gaps:
        return None
    gap, s0, s1, t0, t1 = max(gaps)
    kinds = sorted({e["kind"] for e in run.events if t0 < e["t"] <= t1 and e["kind"] not in ("step", "fingerprint")})
    during = [f"{f['kind']}:{f.get('slot')}" for f in faults
              if f["t_fault"] <= t1 and (f.get("t_recovered") or f.get("t_resumed") or f["t_fault"]) >= t0]
    return {"seconds": round(gap, 4), "after_step": s0, "to_step": s1, "t_start_s": round(t0 - run.t0, 3),
            "faults": during, "events": kinds}


def fingerprint_checks(run: Run) -> dict[str, Any]:
    """Fingerprints published for the same step, committed in the same configuration (the
    ``commit_epoch`` of the state), must be equal. A step that a worker applied alone in an
    older configuration while the others redid it in a newer one is rolled back by the Manager
    (the worker receives the newer state, checked equal there): not compared with theirs.
    FT-HSDP: a rank's fingerprint covers its shard, so only ranks of one shard index compare."""
    by_step: dict[tuple[int, Any, Any], dict[int, str]] = defaultdict(dict)
    for e in run.events:
        if e["kind"] == "fingerprint":
            by_step[(e["step"], e.get("commit_epoch"), e.get("shard"))][e["pid"]] = e["fp"]
    checked = {k: v for k, v in by_step.items() if len(v) > 1}
    bad = sorted({k[0] for k, v in checked.items() if len(set(v.values())) > 1})
    return {"checked_steps": len(checked), "disagreeing_steps": bad, "agreed": not bad}


def build_report(out_dir: Path, *, world_size: int, steps: int, heartbeat_timeout: Optional[float] = None,
                 launcher_returncode: Optional[int] = None, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    out_dir = Path(out_dir)
    run = Run(load_events(out_dir))
    injected = read_jsonl(out_dir / "faults.jsonl")
    launch = read_jsonl(out_dir / "launcher.jsonl")
    faults = [_fault_entry(run, f, injected) for f in injected]
    faults += [_join_entry(run, ev, injected) for ev in launch if ev.get("kind") == "respawned"]
    faults.sort(key=lambda f: f["t_fault"])

    finals = {e["pid"]: e for e in run.events if e["kind"] == "final"}
    hashes = {e["hash"] for e in finals.values()}
    # FT-HSDP: a rank holds its shard index's state; the replicas of each shard must agree
    by_shard: dict[Any, set[str]] = defaultdict(set)
    for e in finals.values():
        by_shard[e.get("shard")].add(e["hash"])
    fps = fingerprint_checks(run)
    completed = bool(finals) and all(e["step"] >= steps for e in finals.values())
    identical = bool(finals) and all(len(h) == 1 for h in by_shard.values()) and fps["agreed"]

    windows = [(f["t_fault"], (f["t_recovered"] or f["t_fault"]) + 1.0) for f in faults]
    windows += [(f["t_fault"], (f.get("t_resumed") or f["t_fault"]) + 1.0) for f in faults if f["kind"] == "freeze"]
    intervals = []
    commits = run.commit_times()
    for (s0, t0), (s1, t1) in zip(commits, commits[1:]):
        if s1 != s0 + 1 or s1 <= WARMUP_STEPS:
            continue
        if any(a - 0.0 <= t1 and t0 <= b for a, b in windows):
            continue
        intervals.append(t1 - t0)
    curve = run.loss_curve()
    pause = longest_pause(run, faults)
    report: dict[str, Any] = {
        "world_size": world_size,
        "steps": steps,
        "completed": completed,
        "replicas_identical": identical,
        "step_time_median_s": round(statistics.median(intervals), 5) if intervals else None,
        "longest_pause_s": pause["seconds"] if pause else None,
        "longest_pause": pause,
        "faults": faults,
        "heartbeat_timeout_s": heartbeat_timeout,
        "steps_committed": max(run.commits, default=0),
        "final_hashes": sorted(hashes),
        "final_hashes_by_shard": ({str(k): sorted(v) for k, v in sorted(by_shard.items(), key=lambda kv: str(kv[0]))}
                                  if None not in by_shard else None),
        "final_ranks": len(finals),
        "fingerprint_checks": fps,
        "loss_first": curve[0][1] if curve else None,
        "loss_last": curve[-1][1] if curve else None,
        "duration_s": round(max(run.commits.values()) - run.t0, 3) if run.commits else None,
        "launcher_returncode": launcher_returncode,
        "t0": run.t0,
    }
    if extra:
        report.update(extra)
    return report


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    path = Path(out_dir) / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path

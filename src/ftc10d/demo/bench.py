"""``ftc10d bench recovery``: what ftc10d costs per step and what it saves at a fault.

(a) Overhead, no faults: the demo's job (same model, data and worker script) with plain
    torch DDP over ``init_process_group("gloo")`` and through ftc10d. Measured two ways:
    in the same 4 processes, alternating blocks of 25 steps (ABBA), which sees the same
    machine load on both sides (the figure the target is checked against); and as separate
    runs (torchrun vs ftc10d launch), interleaved, which on a shared machine is noisy.
    Median interval between consecutive committed steps, warm-up excluded.
(b) Recovery after a SIGKILL: ftc10d (survivors' first commit after the kill, stall,
    the warm replacement's first commit; a freeze too) vs ``torchrun --max-restarts 1``
    with the plain script (time from the kill to the first step after the restart;
    the restarted job starts again from its last checkpoint, here from step 0).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ftc10d.demo.driver import WORKER, DemoConfig, Tail, run_demo
from ftc10d.demo.faults import parse_schedule
from ftc10d.demo.report import Run, load_events

WARMUP = 30


class NullView:
    def start(self, state: Any) -> None:
        pass

    def update(self, state: Any) -> None:
        state.new_log.clear()

    def stop(self) -> None:
        pass


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def step_intervals(out: Path, warmup: int = WARMUP) -> list[float]:
    """Intervals between consecutive job commits after ``warmup`` steps (one run, no fault)."""
    commits = Run(load_events(out)).commit_times()
    return [t1 - t0 for (s0, t0), (s1, t1) in zip(commits, commits[1:]) if s1 == s0 + 1 and s0 >= warmup]


def _torchrun(out: Path, world: int, steps: int, max_restarts: int = 0) -> subprocess.Popen:
    shutil.rmtree(out, ignore_errors=True)
    (out / "events").mkdir(parents=True)
    log = open(out / "torchrun.log", "wb")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           f"--max-restarts={max_restarts}", WORKER, "--plain", "--out", str(out), "--steps", str(steps)]
    return subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_plain(out: Path, world: int, steps: int, timeout: float = 300) -> list[float]:
    proc = _torchrun(out, world, steps)
    try:
        rc = proc.wait(timeout)
    finally:
        _kill_group(proc)
    if rc != 0:
        raise RuntimeError(f"plain DDP run failed (exit {rc}); see {out}/torchrun.log")
    return step_intervals(out)


def run_ftc10d(out: Path, world: int, steps: int, faults: str = "none", hb: float = 1.0,
               spares: int = 0) -> dict[str, Any]:
    cfg = DemoConfig(out, world_size=world, steps=steps, heartbeat_timeout=hb, spares=spares,
                     faults=parse_schedule(faults, world_size=world, steps=steps))
    code, report = run_demo(cfg, NullView())
    if code != 0:
        raise RuntimeError(f"ftc10d run failed (completed={report['completed']}, "
                           f"identical={report['replicas_identical']}); see {out}")
    return report


def ab_blocks(out: Path, world: int, steps: int, block: int, mesh: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Plain DDP and ftc10d DDP (with ``mesh``: torch's HSDP and FT-HSDP) in alternating blocks
    inside the same processes (``worker.py --ab-block``)."""
    cfg = DemoConfig(out, world_size=world, steps=steps, spares=0, extra_args=["--ab-block", str(block)], mesh=mesh)
    run_demo(cfg, NullView())
    events = [e for e in load_events(out) if e["kind"] == "step"]
    commits: dict[int, tuple[float, str, int]] = {}
    for e in events:
        k = e["step"]
        if k not in commits or e["t"] < commits[k][0]:
            commits[k] = (e["t"], e["mode"], e["block"])
    per_block: dict[int, list[float]] = {}
    mode_of: dict[int, str] = {}
    items = sorted(commits.items())
    for (k0, (t0, m0, b0)), (k1, (t1, m1, b1)) in zip(items, items[1:]):
        if k1 == k0 + 1 and b0 == b1 and k1 - b1 * block > 3 and b1 >= 2:  # skip each block's first steps, and
            per_block.setdefault(b1, []).append(t1 - t0)                 # the first two blocks (warm-up)
            mode_of[b1] = m1
    med = {b: statistics.median(v) for b, v in per_block.items()}
    ratios = []
    for b in sorted(med):
        partner = b + 1 if b % 2 == 0 else b - 1
        if mode_of.get(b) == "ftc10d" and partner in med:
            ratios.append(med[b] / med[partner])
    pooled = {m: statistics.median([x for b, v in per_block.items() if mode_of[b] == m for x in v])
              for m in ("plain", "ftc10d") if any(mode_of[b] == m for b in per_block)}
    return {"block_steps": block, "blocks": len(med), "plain_median_step_s": pooled.get("plain"),
            "ftc10d_median_step_s": pooled.get("ftc10d"), "paired_ratios": ratios,
            "ratio": statistics.median(ratios) if ratios else None}


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def torchrun_restart(out: Path, world: int, steps: int, kill_at: int, timeout: float = 300) -> dict[str, Any]:
    """torchrun --max-restarts 1: SIGKILL rank 1 at step ``kill_at``; kill -> first step after the restart."""
    proc = _torchrun(out, world, steps, max_restarts=1)
    tail, pids, step, t_kill = Tail(out / "events"), {}, 0, None
    deadline = time.monotonic() + timeout
    try:
        while t_kill is None and time.monotonic() < deadline and proc.poll() is None:
            for e in tail.poll():
                if e["kind"] == "start":
                    pids[e["slot"]] = e["pid"]
                elif e["kind"] == "step":
                    step = max(step, e["step"])
            if step >= kill_at and 1 in pids:
                t_kill = time.time()
                os.kill(pids[1], signal.SIGKILL)
            time.sleep(0.01)
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        _kill_group(proc)
    if t_kill is None:
        raise RuntimeError(f"torchrun run ended before step {kill_at}; see {out}/torchrun.log")
    events = load_events(out)
    restarted = {e["pid"] for e in events if e["kind"] == "start" and e.get("restart", 0) >= 1}
    after = [e for e in events if e["pid"] in restarted]
    starts = [e["t"] for e in after if e["kind"] == "start"]
    admitted = [e["t"] for e in after if e["kind"] == "admitted"]
    first = [e["t"] for e in after if e["kind"] == "step" and e.get("ok")]
    return {
        "returncode": rc, "killed_at_step": step, "t_kill": t_kill,
        "restarted_workers_started_s": (min(starts) - t_kill) if starts else None,
        "rendezvous_done_s": (max(admitted) - t_kill) if admitted else None,
        "first_step_after_restart_s": (min(first) - t_kill) if first else None,
        "steps_lost_without_checkpoint": step,
    }


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def bench_recovery(out: Path, *, world: int = 4, steps: int = 300, rounds: int = 2, quiet: bool = False,
                   hb: float = 1.0) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.time()
    plain: list[float] = []
    ftc: list[float] = []
    paired: list[float] = []
    for r in range(rounds):
        order = ["plain", "ftc10d"] if r % 2 == 0 else ["ftc10d", "plain"]
        got: dict[str, float] = {}
        for kind in order:
            d = out / f"overhead-{kind}-{r}"
            _say(f"bench recovery: round {r + 1}/{rounds}: {kind}, {steps} steps ...", quiet)
            if kind == "plain":
                xs = run_plain(d, world, steps)
            else:
                run_ftc10d(d, world, steps)
                xs = step_intervals(d)
            (plain if kind == "plain" else ftc).extend(xs)
            got[kind] = statistics.median(xs)
            _say(f"  median step {got[kind] * 1000:.1f} ms", quiet)
        paired.append(got["ftc10d"] / got["plain"])
    overhead = {
        "steps_per_run": steps, "warmup_steps": WARMUP, "rounds": rounds,
        "plain_median_step_s": _median(plain), "ftc10d_median_step_s": _median(ftc),
        "ratio": (_median(ftc) or 0) / (_median(plain) or 1), "paired_ratios": paired,
        "plain_p90_step_s": statistics.quantiles(plain, n=10)[-1] if len(plain) > 10 else None,
        "ftc10d_p90_step_s": statistics.quantiles(ftc, n=10)[-1] if len(ftc) > 10 else None,
    }
    _say(f"bench recovery: plain DDP and ftc10d in alternating blocks of 25 steps in the same processes, "
         f"{2 * steps} steps ...", quiet)
    ab = ab_blocks(out / "overhead-ab", world, 2 * steps, 25)
    _say("bench recovery: ftc10d under kill:1@60,freeze:2@160:2 with a warm spare ...", quiet)
    rep = run_ftc10d(out / "recovery-ftc10d", world, max(steps, 300), "kill:1@60,freeze:2@160:2", hb=hb, spares=1)
    med = rep["step_time_median_s"] or float("nan")
    faults = {f["kind"]: f for f in rep["faults"]}
    kill, join, freeze = faults.get("kill", {}), faults.get("join", {}), faults.get("freeze", {})
    ftc_rec = {
        "step_time_median_s": med, "heartbeat_timeout_s": hb,
        "kill_first_commit_s": kill.get("first_commit_s"), "kill_stall_s": kill.get("stall_s"),
        "kill_stall_steps": (kill.get("stall_s") or 0) / med, "kill_steps_lost": kill.get("steps_lost"),
        "join_first_commit_since_kill_s": join.get("since_kill_s"), "join_warm": join.get("warm"),
        "join_stall_s": join.get("stall_s"),
        "freeze_first_commit_s": freeze.get("first_commit_s"), "freeze_stall_s": freeze.get("stall_s"),
        "freeze_rejoined": freeze.get("rejoined"), "replicas_identical": rep["replicas_identical"],
        "longest_pause_s": rep.get("longest_pause_s"), "longest_pause": rep.get("longest_pause"),
    }
    _say("bench recovery: torchrun --max-restarts 1, SIGKILL rank 1 at step 60 ...", quiet)
    tr = torchrun_restart(out / "recovery-torchrun", world, 120, 60)
    result = {
        "world_size": world, "overhead": overhead, "overhead_same_process": ab, "ftc10d": ftc_rec, "torchrun": tr,
        "restart_vs_ftc10d": (tr["first_step_after_restart_s"] or 0) / (kill.get("first_commit_s") or 1),
        "restart_vs_replacement": (tr["first_step_after_restart_s"] or 0) / (join.get("since_kill_s") or 1),
        "targets": {
            "overhead_ratio_le_1.05": (ab["ratio"] or 9) <= 1.05,
            "kill_first_commit_le_100ms": (kill.get("first_commit_s") or 9) <= 0.1,
            "kill_stall_le_2_steps": ftc_rec["kill_stall_steps"] <= 2,
            "freeze_recommit_le_hb_plus_100ms": (freeze.get("first_commit_s") or 99) <= hb + 0.1,
            "warm_join_le_500ms_after_kill": (join.get("since_kill_s") or 9) <= 0.5,
            "longest_pause_le_hb_plus_1s": (rep.get("longest_pause_s") or 99) <= hb + 1.0,
        },
        "seconds": round(time.time() - t_begin, 1),
        "cpus": os.cpu_count(),
    }
    (out / "bench-recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def format_result(r: dict[str, Any]) -> str:
    o, ab, f, t = r["overhead"], r["overhead_same_process"], r["ftc10d"], r["torchrun"]
    ok = {True: "met", False: "MISSED"}
    tg = r["targets"]
    lines = [
        f"bench recovery: {r['world_size']} workers, {r['cpus']} CPUs, {r['seconds']} s",
        "",
        f"(a) per-step cost, no faults: the same 4 processes alternate blocks of {ab['block_steps']} steps of plain "
        f"DDP and ftc10d ({ab['blocks']} blocks measured)",
        f"    plain torch DDP (init_process_group gloo)  median {_ms(ab['plain_median_step_s'])}",
        f"    ftc10d (DDP through Manager)               median {_ms(ab['ftc10d_median_step_s'])}",
        f"    ratio ftc10d / plain, median of pairs      {ab['ratio'] or 0:.3f}x (pairs: "
        f"{', '.join(f'{x:.2f}' for x in ab['paired_ratios'])})   target <= 1.05x: "
        f"{ok[tg['overhead_ratio_le_1.05']]}",
        f"    separate runs ({o['rounds']} interleaved rounds x {o['steps_per_run']} steps, first "
        f"{o['warmup_steps']} excluded): plain {_ms(o['plain_median_step_s'])} (torchrun), ftc10d "
        f"{_ms(o['ftc10d_median_step_s'])} (ftc10d launch), ratio {o['ratio']:.3f}x (per round: "
        f"{', '.join(f'{x:.2f}' for x in o['paired_ratios'])})",
        "",
        "(b) recovery after SIGKILL of one of 4 workers",
        f"    ftc10d survivors' first commit    {_ms(f['kill_first_commit_s'])} after the kill   "
        f"target <= 100 ms: {ok[tg['kill_first_commit_le_100ms']]}",
        f"    ftc10d stall                      {_ms(f['kill_stall_s'])} = {f['kill_stall_steps']:.1f} steps "
        f"({f['kill_steps_lost']} attempts thrown away)   target <= 2 steps: {ok[tg['kill_stall_le_2_steps']]}",
        f"    ftc10d warm replacement           first commit {_ms(f['join_first_commit_since_kill_s'])} after the "
        f"kill   target <= 500 ms: {ok[tg['warm_join_le_500ms_after_kill']]}",
        f"    ftc10d freeze (hb {f['heartbeat_timeout_s']:g} s)           survivors recommit "
        f"{_ms(f['freeze_first_commit_s'])} after SIGSTOP   target <= hb + 100 ms: "
        f"{ok[tg['freeze_recommit_le_hb_plus_100ms']]}",
        f"    ftc10d longest pause of the job    {_ms(f.get('longest_pause_s'))} between two commits (whatever "
        f"the cause: fault, join, rejoin)   target <= hb + 1 s: {ok[tg['longest_pause_le_hb_plus_1s']]}",
        f"    torchrun --max-restarts 1         first step {_ms(t['first_step_after_restart_s'])} after the kill "
        f"(workers restarted {_ms(t['restarted_workers_started_s'])}, rendezvous {_ms(t['rendezvous_done_s'])}); "
        f"{t['steps_lost_without_checkpoint']} steps to redo without a checkpoint",
        f"    ratio torchrun / ftc10d           {r['restart_vs_ftc10d']:.1f}x (survivors), "
        f"{r['restart_vs_replacement']:.1f}x (replacement)",
    ]
    return "\n".join(lines)


def main(*, out: str, as_json: bool, steps: int, rounds: int) -> int:
    result = bench_recovery(Path(out), steps=steps, rounds=rounds, quiet=as_json)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(format_result(result))
    return 0

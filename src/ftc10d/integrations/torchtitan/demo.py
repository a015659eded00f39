"""``make demo-titan``: torchtitan's llama3 debug model on 2 replicas x 2 FSDP2 shards (CPU,
Gloo), one rank SIGKILLed, then a whole replica; a summary of what the job went through.

    python -m ftc10d.integrations.torchtitan.demo [--out DIR] [--steps 30]

What it shows: the job completes every step without a restart; the replica that lost a rank
waits warm while the other commits on; the replacements receive their shards live (no
checkpoint); every committed step was committed in one configuration; the holders of each
shard end bitwise identical; the loss goes down; the longest pause between two commits of
the job (and per slot: a replica waiting for its replacement pauses longer than the job).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

from ftc10d.integrations.torchtitan.job import TitanJob


def summary(job: TitanJob, kills: list[tuple[str, float]]) -> tuple[list[str], bool]:
    """The report's lines, and whether every check holds."""
    events = job.events()
    commits = [e for e in events if e["kind"] == "step" and e["ok"]]
    by_step: dict[int, list[dict]] = collections.defaultdict(list)
    for e in commits:
        by_step[e["step"]].append(e)
    epochs = {s: {e["epoch"] for e in es} for s, es in by_step.items()}
    commit_times = sorted(min(e["t"] for e in es) for es in by_step.values())
    gaps = [b - a for a, b in zip(commit_times, commit_times[1:])]
    finals: dict[int, set] = collections.defaultdict(set)
    for e in events:
        if e["kind"] == "final":
            finals[e["shard"]].add(e["hash"][:16])
    fps: dict[tuple[int, int], set] = collections.defaultdict(set)
    for e in events:
        if e["kind"] == "fingerprint":
            fps[(e["step"], e["shard"])].add(e["fp"])
    recovered = sorted({(e["slot"], e["restart"], e["step"], round(e["seconds"], 3)) for e in events
                        if e["kind"] == "recovered" and e["restart"] > 0})
    loss = {s: sum(e["loss"] for e in es) / len(es) for s, es in by_step.items()}
    checks = {
        "every step committed": set(by_step) == set(range(1, job.steps + 1)),
        "each step committed in one configuration": all(len(v) == 1 for v in epochs.values()),
        "holders of each shard agree at every committed step": bool(fps) and all(len(v) == 1 for v in fps.values()),
        "holders of each shard end bitwise identical": bool(finals) and all(len(v) == 1 for v in finals.values()),
        "loss went down": bool(loss) and loss[max(loss)] < loss[min(loss)] - 1.0,
    }
    lines = [f"ftc10d + torchtitan: llama3 debugmodel, {job.replicas} replicas x {job.shard} FSDP2 shards, "
             f"{job.steps} steps (events in {job.events_dir})"]
    t0 = min(e["t"] for e in events)
    lines += [f"  {what} at {t - t0:.1f} s" for what, t in kills]
    lines += [f"  slot {s} (restart {r}) received its shards live at step {st} in {sec:.3f} s"
              for s, r, st, sec in recovered]
    lines.append(f"  loss: step 1 {loss.get(1, float('nan')):.3f} -> step {job.steps} "
                 f"{loss.get(job.steps, float('nan')):.3f}")
    lines.append(f"  longest pause between two commits of the job: {max(gaps, default=0.0):.2f} s "
                 f"(median step {sorted(gaps)[len(gaps) // 2] if gaps else 0.0:.2f} s)")
    per_slot = collections.defaultdict(float)
    for e in commits:
        per_slot[e["slot"]] = max(per_slot[e["slot"]], e["since_commit"])
    lines.append("  longest pause per slot: " + ", ".join(f"{s}: {v:.2f} s" for s, v in sorted(per_slot.items())))
    lines += [f"  shard {s}: final state {'/'.join(sorted(v))}" for s, v in sorted(finals.items())]
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}" for name, ok in checks.items()]
    return lines, all(checks.values())


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m ftc10d.integrations.torchtitan.demo", description=__doc__)
    p.add_argument("--out", default=None, help="where the run's logs, events and assets go (default: a temp dir)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    from ftc10d.integrations.torchtitan.assets import build

    out = args.out or tempfile.mkdtemp(prefix="ftc10d-demo-titan-")
    assets = build(os.path.join(out, "assets"))
    job = TitanJob(os.path.join(out, "job"), steps=args.steps).start(assets)
    kills = []
    print(f"demo-titan: starting 4 workers (logs in {job.out}) ...", flush=True)
    job.wait("step 5", lambda: job.committed() >= 5, 300)
    kills.append(("SIGKILL slot 1 (replica 0, shard 1)", job.kill(1)))
    print("demo-titan: SIGKILLed slot 1; replica 1 trains on while slot 1 is replaced ...", flush=True)
    job.wait("slot 1's replacement to commit", lambda: job.committed(slot=1, restart=1) > 0, 300)
    time.sleep(2.0)
    kills.append(("SIGKILL slots 2 and 3 (all of replica 1)", job.kill(2, 3)))
    print("demo-titan: SIGKILLed replica 1 (slots 2, 3); replica 0 trains on ...", flush=True)
    code = job.finish(600)
    lines, ok = summary(job, kills)
    print("\n".join(lines))
    print(f"demo-titan: launcher exit code {code}")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""torchtitan on ftc10d's FT-HSDP vs torchtitan's own HSDP over plain Gloo groups: the cost per
step when nothing fails, and what a SIGKILL costs (issue 26). Run in the torchtitan virtualenv:

    .venvtitan/bin/python benchmarks/titan_step.py [--rounds 3] [--steps 20] [--recovery]

Per step: the same model (llama3 debugmodel), data, flags and 4 processes (2 replicas x 2 FSDP2
shards, CPU, Gloo), launched alternately (A B A B ...: this machine is noisy), each measured as
the median interval between rank 0's consecutive torchtitan metric lines (``--metrics.log-freq
1``) over steps 6..N (the first steps warm up); the ratio is the median over rounds of each
round's back-to-back pair (ftc10d / torchtitan). A = torchtitan's ``--parallelism.data-parallel-
replicate-degree 2 --parallelism.data-parallel-shard-degree 2`` (its own 2-D mesh of plain Gloo
groups); B = ``--module ftc10d.integrations.torchtitan`` (ftc10d groups, the commit vote, the
replicate all-reduce through ftc10d's group). Prints each round and the ratio of the medians.

``--recovery``: one FT-HSDP run, a rank SIGKILLed at step 6: the time from the kill to the
surviving replica's next commit, to the replacement's first commit, and the job's longest pause.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

STEP_LINE = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* step:\s+(\d+)\s")


def _env(out: str) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                HF_DATASETS_CACHE=os.path.join(out, "hf"), OMP_NUM_THREADS="1", FTC10D_TITAN_DEVICE="cpu")


def run(kind: str, out: str, assets: tuple[str, str], steps: int) -> float:
    """One job; returns its median step interval (seconds) over steps 6..steps."""
    from ftc10d.integrations.torchtitan.job import MODEL_FLAGS, script

    flags = list(MODEL_FLAGS)
    if kind == "torchtitan":
        i = flags.index("--module")
        flags[i + 1:i + 4] = ["llama3", "--config", "llama3_debugmodel"]
        flags += ["--parallelism.data-parallel-replicate-degree", "2", "--parallelism.data-parallel-shard-degree", "2"]
    else:
        flags += ["--ftc10d.replicas", "2"]
    logs = os.path.join(out, "logs")
    cmd = [sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "4", "--log-dir", logs, script(), *flags,
           "--hf-assets-path", assets[0], "--dataloader.dataset-path", assets[1], "--dump-folder",
           os.path.join(out, "dump"), "--training.steps", str(steps), "--metrics.log-freq", "1"]
    subprocess.run(cmd, env=_env(out), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    times: dict[int, float] = {}
    for name in ("worker0.0.err", "worker0.0.out"):
        with open(os.path.join(logs, name)) as f:
            for line in f:
                m = STEP_LINE.search(line)
                if m:
                    t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    times.setdefault(int(m.group(2)), t)
    gaps = [times[s] - times[s - 1] for s in range(6, steps + 1) if s in times and s - 1 in times]
    if len(gaps) < steps // 2:
        raise RuntimeError(f"{kind}: only {len(gaps)} step intervals in {logs}")
    return statistics.median(gaps)


def recovery(out: str, assets: tuple[str, str], steps: int) -> None:
    from ftc10d.integrations.torchtitan.job import TitanJob

    job = TitanJob(out, steps=steps).start(assets)
    job.wait("step 6", lambda: job.committed() >= 6, 600)
    t_kill = job.kill(1)
    job.wait("the replacement's first commit", lambda: job.committed(slot=1, restart=1) > 0, 600)
    if job.finish(900) != 0:
        raise RuntimeError(f"the job failed; see {out}")
    ev = job.events()
    commits = [e for e in ev if e["kind"] == "step" and e["ok"]]
    # the first step replica 1 *started* after the kill and committed (the one in flight fails: its
    # vote needs every participant; a commit that was landing at the kill does not count)
    survivor = min(e["t"] for e in commits if e["t0"] > t_kill and e["replica"] == 1)
    replacement = min(e["t"] for e in commits if e["slot"] == 1 and e["restart"] == 1)
    times = sorted({min(x["t"] for x in commits if x["step"] == s) for s in {e["step"] for e in commits}})
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"SIGKILL slot 1 (replica 0) -> replica 1's next commit: {survivor - t_kill:.2f} s")
    print(f"SIGKILL slot 1 -> the replacement's first commit (cold start, torchtitan import and init included): "
          f"{replacement - t_kill:.2f} s")
    print(f"the job's longest pause between two commits: {max(gaps):.2f} s; "
          f"median step {statistics.median(gaps):.2f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recovery", action="store_true")
    args = p.parse_args()
    from ftc10d.integrations.torchtitan.assets import build

    base = tempfile.mkdtemp(prefix="ftc10d-bench-titan-")
    assets = build(os.path.join(base, "assets"))
    if args.recovery:
        recovery(os.path.join(base, "recovery"), assets, 30)
        return 0
    res: dict[str, list[float]] = {"torchtitan": [], "ftc10d": []}
    for r in range(args.rounds):
        order = ("torchtitan", "ftc10d") if r % 2 == 0 else ("ftc10d", "torchtitan")
        for kind in order:
            t0 = time.monotonic()
            res[kind].append(run(kind, os.path.join(base, f"{kind}-{r}"), assets, args.steps))
            print(f"round {r} {kind:10s}: median step {res[kind][-1] * 1e3:7.1f} ms  ({time.monotonic() - t0:.0f} s)",
                  flush=True)
    a, b = statistics.median(res["torchtitan"]), statistics.median(res["ftc10d"])
    pairs = [y / x for x, y in zip(res["torchtitan"], res["ftc10d"])]  # each round's two runs, back to back
    print(f"torchtitan HSDP (plain Gloo) {a * 1e3:.1f} ms/step | ftc10d FT-HSDP {b * 1e3:.1f} ms/step "
          f"(medians of {args.rounds} rounds, steps 6..{args.steps})")
    print(f"ratio ftc10d / torchtitan: median of the rounds' pairs {statistics.median(pairs):.3f}x "
          f"(pairs: {', '.join(f'{r:.3f}' for r in pairs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step cost of comparing the replicas in the vote (``Manager(check_every=K)``) against
plain torch DDP and against ftc10d without the check.

The demo's job (4 workers under ``ftc10d launch``, the 0.46 M-parameter MLP, Adam, DDP), with
every worker holding two copies of the model: one under torch's DDP over a plain Gloo group,
one under DDP through ftc10d's Manager. They alternate blocks of ``--block`` steps in the order
plain, ftc10d, check, check, ftc10d, plain (``check`` is the same Manager with ``check_every=K``:
one fingerprint of model and Adam state every K steps, carried by the vote), so that every mode
sees the same machine load. Per block the mean step time (its first 3 steps and the first
round's first two blocks left out; a mean, because the check's cost falls on one step in K,
which a median would hide); per round each mode's median block, its ratio to plain's, and
check's to ftc10d's; the figures are the medians over rounds.

    python benchmarks/replica_check.py [--rounds 3] [--block 100] [--check-every 100] [--json out.json]

About 45 s a round on 2 cores. Target (issue 18): check / plain <= 1.02x at K = 100.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import dump_json, machine  # noqa: E402
from ftc10d.demo.bench import NullView  # noqa: E402
from ftc10d.demo.driver import DemoConfig, run_demo  # noqa: E402
from ftc10d.demo.report import load_events  # noqa: E402

ORDER = ("plain", "ftc10d", "check", "check", "ftc10d", "plain")


def run(out: Path, block: int, rounds: int, check_every: int, world: int = 4) -> dict[str, Any]:
    steps = block * len(ORDER) * rounds
    cfg = DemoConfig(out, world_size=world, steps=steps, spares=0,
                     extra_args=["--ab-block", str(block), "--ab-check", str(check_every)])
    run_demo(cfg, NullView())
    first: dict[int, tuple[float, str, int]] = {}  # step -> (earliest commit time, mode, block)
    for e in load_events(out):
        if e["kind"] == "step" and (e["step"] not in first or e["t"] < first[e["step"]][0]):
            first[e["step"]] = (e["t"], e["mode"], e["block"])
    per_block: dict[int, list[float]] = {}
    mode_of: dict[int, str] = {}
    items = sorted(first.items())
    for (k0, (t0, _, b0)), (k1, (t1, m1, b1)) in zip(items, items[1:]):
        if k1 == k0 + 1 and b0 == b1 and k1 - b1 * block > 3 and b1 >= 2:
            per_block.setdefault(b1, []).append(t1 - t0)
            mode_of[b1] = m1
    # The mean, not the median: the check costs one step in K, which a median would not see.
    med = {b: statistics.fmean(v) for b, v in per_block.items()}
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        blocks = [b for b in med if b // len(ORDER) == r]
        by_mode = {m: statistics.median([med[b] for b in blocks if mode_of[b] == m])
                   for m in set(ORDER) if any(mode_of[b] == m for b in blocks)}
        if len(by_mode) == 3:
            per_round.append(by_mode)
    ratios = {
        "ftc10d/plain": [r["ftc10d"] / r["plain"] for r in per_round],
        "check/plain": [r["check"] / r["plain"] for r in per_round],
        "check/ftc10d": [r["check"] / r["ftc10d"] for r in per_round],
    }
    return {"block": block, "rounds": rounds, "check_every": check_every, "per_round_median_step_s": per_round,
            "ratios": ratios, "median_ratio": {k: statistics.median(v) for k, v in ratios.items() if v}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftc10d-replica-check-") as tmp:
        res = run(Path(tmp), args.block, args.rounds, args.check_every)
    print(f"replica check cost: 4 ranks, blocks of {args.block} steps in the order {', '.join(ORDER)}, "
          f"{args.rounds} rounds, check_every={args.check_every}; {machine()}")
    print("| round | plain ms/step | ftc10d ms/step | check ms/step | ftc10d/plain | check/plain | check/ftc10d |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(res["per_round_median_step_s"]):
        print(f"| {i} | {r['plain'] * 1e3:.1f} | {r['ftc10d'] * 1e3:.1f} | {r['check'] * 1e3:.1f} | "
              f"{r['ftc10d'] / r['plain']:.3f} | {r['check'] / r['plain']:.3f} | {r['check'] / r['ftc10d']:.3f} |")
    m = res["median_ratio"]
    if m:
        verdict = "met" if m["check/plain"] <= 1.02 else "MISSED"
        print(f"median over rounds: ftc10d/plain {m['ftc10d/plain']:.3f}x, check/plain {m['check/plain']:.3f}x "
              f"(target <= 1.02x: {verdict}), check/ftc10d {m['check/ftc10d']:.3f}x")
    dump_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

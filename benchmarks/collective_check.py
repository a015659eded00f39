"""What the collective check (``check_collectives`` / ``FTC10D_CHECK_COLLECTIVES=1``) costs.

Two measures, each a ratio against a baseline measured in the same run:

1. A DDP training step (the demo's job, 4 workers): plain torch DDP and ftc10d DDP in
   alternating blocks of 25 steps inside the same processes (``ftc10d bench recovery``'s
   A/B), once with the check off and once with it on, alternating the two runs. The
   figure is the median of paired ftc10d/plain block ratios, check on vs off.
2. One all-reduce (``benchmarks/allreduce_overhead.py --check-collectives``): the check
   adds a 16-byte all-reduce before each op, so small ops pay up to one extra round trip.

    python benchmarks/collective_check.py [--rounds 2] [--steps 300] [--out bench-out/check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftc10d.demo.bench import ab_blocks  # noqa: E402
from ftc10d.pg.signature import CHECK_ENV  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting (alternated: off, on, on, off, ...)")
    ap.add_argument("--steps", type=int, default=300, help="steps per run (blocks of 25, plain/ftc10d alternating)")
    ap.add_argument("--out", default="bench-out/check")
    args = ap.parse_args(argv)
    ratios: dict[str, list[float]] = {"off": [], "on": []}
    steps: dict[str, list[float]] = {"off": [], "on": []}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            os.environ[CHECK_ENV] = "1" if mode == "on" else "0"
            res = ab_blocks(Path(args.out) / f"{mode}-{r}", 4, args.steps, 25)
            ratios[mode].extend(res["paired_ratios"])
            steps[mode].append(res["ftc10d_median_step_s"])
            print(f"round {r + 1}/{args.rounds} check {mode}: ftc10d/plain {res['ratio']:.3f} "
                  f"(ftc10d step {res['ftc10d_median_step_s'] * 1e3:.1f} ms, "
                  f"plain {res['plain_median_step_s'] * 1e3:.1f} ms)", flush=True)
    off, on = statistics.median(ratios["off"]), statistics.median(ratios["on"])
    print()
    print("DDP step, 4 workers, median of paired block ratios vs plain torch DDP in the same processes")
    print(f"{'check':<8}{'ftc10d/plain':>14}{'ftc10d step (ms)':>18}{'blocks':>8}")
    for mode, ratio in (("off", off), ("on", on)):
        print(f"{mode:<8}{ratio:>14.3f}{statistics.median(steps[mode]) * 1e3:>18.1f}{len(ratios[mode]):>8}")
    print(f"cost of the check per step: {on / off:.3f}x  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Flight recorder cost per op: the same group with and without recording, side by side.

Three views, because on a 2-core machine a 4-rank allreduce's noise (±5-10%)
dwarfs a few microseconds:

1. ``record()`` alone, in a loop: the pure bookkeeping cost.
2. World size 1 (no network): ``allreduce(4 KiB).wait()`` on a recorded and an
   unrecorded group, interleaved blocks: the added cost on the issue path.
3. 4 ranks, 4 KiB allreduce, recorded vs unrecorded groups interleaved, with
   the noise floor of two identical unrecorded groups.

Target: <= 3 us added per op; memory bounded by the ring (TORCH_FR_BUFFER_SIZE).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ftc10d
from benchmarks import _common as C
from ftc10d.flight_recorder import FlightRecorder, get_recorder

T = timedelta(seconds=60)


def record_cost(n: int) -> float:
    rec = FlightRecorder(capacity=2000)
    t = torch.zeros(1024)
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            rec.record(0, "g", "d", None, i, 0, i, "gloo:all_reduce", [t], [t], 1000, False)
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def _blocks(pgs: list, t: torch.Tensor, rounds: int, block: int) -> list[list[float]]:
    per = [[] for _ in pgs]
    for _ in range(rounds):
        for i, pg in enumerate(pgs):
            t0 = time.perf_counter()
            for _ in range(block):
                pg.allreduce([t]).wait()
            per[i].append((time.perf_counter() - t0) / block * 1e6)
    return per


def single_rank(rounds: int, block: int) -> tuple[float, float]:
    store = C.host_store()
    on = ftc10d.ProcessGroup(dist.PrefixStore("on", store), 0, 1, timeout=T, flight_recorder=True)
    off = ftc10d.ProcessGroup(dist.PrefixStore("off", store), 0, 1, timeout=T, flight_recorder=False)
    t = torch.zeros(1024)
    _blocks([on, off], t, 3, block)  # warm up
    a, b = _blocks([on, off], t, rounds, block)
    return statistics.median(a), statistics.median(b)


def _ranks(rank: int, world: int, port: int, rounds: int, block: int) -> list[float]:
    store = C.client_store(port)
    on = ftc10d.ProcessGroup(dist.PrefixStore("on", store), rank, world, timeout=T, flight_recorder=True)
    off = ftc10d.ProcessGroup(dist.PrefixStore("off", store), rank, world, timeout=T, flight_recorder=False)
    off2 = ftc10d.ProcessGroup(dist.PrefixStore("off2", store), rank, world, timeout=T, flight_recorder=False)
    t = torch.zeros(1024)
    _blocks([on, off, off2], t, 2, block)
    per = _blocks([on, off, off2], t, rounds, block)
    ring = len(get_recorder().entries())
    return [statistics.median(x) for x in per] + [float(ring)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args()
    print(f"flight_recorder_overhead: {C.machine()}")
    rc = record_cost(20000)
    on1, off1 = single_rank(a.rounds, a.block * 4)
    res = C.run(_ranks, a.ranks, a.rounds, a.block)
    on4 = statistics.median(v[0] for v in res.values())
    off4 = statistics.median(v[1] for v in res.values())
    off4b = statistics.median(v[2] for v in res.values())
    ring = max(v[3] for v in res.values())
    rows = [
        ["record() alone", "-", "-", f"{rc:.2f}", "-"],
        ["allreduce 4 KiB, 1 rank", f"{on1:.1f}", f"{off1:.1f}", f"{on1 - off1:+.2f}", f"{on1 / off1:.3f}x"],
        [f"allreduce 4 KiB, {a.ranks} ranks", f"{on4:.1f}", f"{off4:.1f}", f"{on4 - off4:+.2f}", f"{on4 / off4:.3f}x"],
        [f"noise floor (two unrecorded groups), {a.ranks} ranks", f"{off4b:.1f}", f"{off4:.1f}",
         f"{off4b - off4:+.2f}", f"{off4b / off4:.3f}x"],
    ]
    print(C.table(["case", "recorded us/op", "unrecorded us/op", "added us/op", "ratio"], rows))
    print(f"ring entries held after {a.rounds * a.block * 3 + 6 * a.block} ops per rank: {int(ring)} "
          f"(capacity {get_recorder().capacity}); target: <= 3 us added per op")
    C.dump_json(a.json, {"record_us": rc, "one_rank": [on1, off1], "ranks": [on4, off4, off4b], "ring": ring})


if __name__ == "__main__":
    main()

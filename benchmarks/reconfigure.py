"""Time of ``reconfigure()`` + the first allreduce, ftc10d vs torch 2.14's native Gloo.

What a survivor pays to get a working communicator back once the new membership
is agreed: the reconfigure call itself (abort the old generation, meet, connect)
and the first collective on the new one (which on a lazily-connecting backend
is where the connecting really happens). Handle exchange through the store is
out-of-band for both and is not timed.

Each iteration uses a fresh uuid and the same (identity) membership. Both sides
are measured in the same processes, alternating ftc10d and native every
iteration, so load on the machine hits both alike. The time of an iteration is
the slowest rank's, from a store barrier to its allreduce completing. The first
reconfigure of each (which connects from nothing) is reported separately.

Native: ``ProcessGroupGloo(store, rank, size, timeout, enable_reconfigure=True)``
driven with ``get_reconfigure_handle()`` / ``reconfigure(ReconfigureOptions)``
(what ``dist._reconfigure`` does); its handles embed a listening address and
go stale after each reconfigure, so they are re-read and re-exchanged every
time. On torch < 2.14 there is no native reconfigure and only ftc10d is shown.

    python benchmarks/reconfigure.py [--ranks 2,4,8] [--iters 40] [--no-native] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    HAS_NATIVE_RECONFIGURE,
    client_store,
    dump_json,
    exchange,
    machine,
    percentile,
    run,
    store_barrier,
    table,
)

#: Native figures measured earlier on this project's reference run (p50, ms).
NATIVE_EARLIER_P50_MS = {2: 11.0, 4: 23.0, 8: 58.0}
TARGET_RATIO = 0.5  # ftc10d p50 <= 0.5x native at 4 and 8 ranks


def worker(rank: int, world: int, port: int, iters: int, native: bool) -> dict[str, dict[str, list[float]]]:
    """One rank: alternate ftc10d and native reconfigures, timing each to its first allreduce."""
    import ftc10d

    store = client_store(port)
    timeout = timedelta(seconds=60)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("ftc10d", store), rank, world, timeout=timeout, enable_reconfigure=True)
    steps: dict[str, Callable[[int, list[str]], None]] = {}
    handles: dict[str, Callable[[], str]] = {"ftc10d": pg.get_reconfigure_handle}

    def ftc_step(uuid: int, hs: list[str]) -> None:
        ftc10d.reconfigure(uuid, hs, group=pg)

    steps["ftc10d"] = ftc_step
    if native:
        from torch._C._distributed_c10d import ReconfigureOptions

        nat = dist.ProcessGroupGloo(dist.PrefixStore("native", store), rank, world, timeout, True)

        def native_step(uuid: int, hs: list[str]) -> None:
            o = ReconfigureOptions()
            o.uuid = uuid
            o.handles = hs
            o.timeout = timeout
            nat.reconfigure(o).wait()

        steps["native"] = native_step
        handles["native"] = nat.get_reconfigure_handle
    groups: dict[str, Any] = {"ftc10d": pg, **({"native": nat} if native else {})}

    out: dict[str, dict[str, list[float]]] = {k: {"total": [], "call": []} for k in steps}
    t = torch.ones(4)
    for it in range(iters + 1):  # iteration 0: first connect, reported apart
        order = list(steps) if it % 2 == 0 else list(reversed(steps))
        for impl in order:
            name = f"{impl}/{it}"
            hs = exchange(store, name, rank, world, handles[impl]())  # out of band, untimed
            store_barrier(store, name, world)
            t0 = time.perf_counter()
            steps[impl](1000 + it, hs)
            t1 = time.perf_counter()
            t.fill_(1.0)
            groups[impl].allreduce([t]).wait()
            out[impl]["total"].append(time.perf_counter() - t0)
            out[impl]["call"].append(t1 - t0)
            if t[0].item() != world:
                raise AssertionError(f"{impl} iteration {it}: allreduce gave {t[0].item()}, expected {world}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated world sizes")
    ap.add_argument("--iters", type=int, default=40, help="timed reconfigures per implementation and world size")
    ap.add_argument("--no-native", action="store_true", help="skip torch's native Gloo reconfigure")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    native = HAS_NATIVE_RECONFIGURE and not args.no_native
    worlds = [int(w) for w in args.ranks.split(",")]

    t_start = time.perf_counter()
    summary: dict[int, dict[str, Any]] = {}
    for world in worlds:
        res = run(worker, world, args.iters, native, timeout=600)
        summary[world] = {}
        for impl in res[0]:
            v = [max(vals) for vals in zip(*(r[impl]["total"] for r in res.values()))]
            call = [max(vals) for vals in zip(*(r[impl]["call"] for r in res.values()))]
            summary[world][impl] = {
                "first_s": v[0],
                "p50_s": percentile(v[1:], 50),
                "p90_s": percentile(v[1:], 90),
                "call_p50_s": percentile(call[1:], 50),
                "samples_s": v[1:],
                "call_samples_s": call[1:],
            }
    wall = time.perf_counter() - t_start

    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    rows = []
    for world in worlds:
        f = summary[world]["ftc10d"]
        row = [world, ms(f["p50_s"]), ms(f["p90_s"]), ms(f["call_p50_s"]), ms(f["first_s"])]
        if native:
            n = summary[world]["native"]
            ratio = f["p50_s"] / n["p50_s"]
            summary[world]["ratio_p50"] = ratio
            verdict = ("met" if ratio <= TARGET_RATIO else "MISSED") if world >= 4 else "-"
            row += [ms(n["p50_s"]), ms(n["p90_s"]), ms(n["call_p50_s"]), ms(n["first_s"]), f"{ratio:.2f}x",
                    f"<= {TARGET_RATIO}x" if world >= 4 else "-", verdict]
        else:
            earlier = NATIVE_EARLIER_P50_MS.get(world)
            row += [f"{earlier:.0f}" if earlier else "?", f"{f['p50_s'] * 1e3 / earlier:.2f}x" if earlier else "?"]
        rows.append(row)

    print(f"reconfigure: reconfigure() + first allreduce (4 floats), identity membership, fresh uuid each time, "
          f"{args.iters} timed iterations (slowest rank); {machine()}; {wall:.0f} s")
    if native:
        print(table(["ranks", "ftc10d p50 ms", "p90", "call p50", "first", "native p50 ms", "p90", "call p50", "first",
                     "ftc10d/native p50", "target", "verdict"], rows))
    else:
        print("native Gloo reconfigure: unavailable (torch < 2.14 or --no-native); ftc10d only. "
              "Last column compares with native p50s measured earlier under torch 2.14.")
        print(table(["ranks", "ftc10d p50 ms", "p90", "call p50", "first", "native p50 (earlier) ms", "ftc10d/earlier"],
                    rows))
    print("p50/p90: reconfigure() + first allreduce, over the timed iterations; call p50: the reconfigure() call "
          "alone; first: the very first reconfigure (connects from nothing, no old generation), not in p50/p90.")
    dump_json(args.json, {"benchmark": "reconfigure", "machine": machine(), "iters": args.iters,
                          "native": native, "wall_s": wall, "worlds": {str(w): summary[w] for w in worlds}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

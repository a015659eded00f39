"""``make gpu-check``: ftc10d's NCCL adapter on a machine with one GPU (issue 17).

Runs on the torch the machine has (>= 2.11, CUDA, NCCL) and installs nothing: it needs only
torch and this checkout (``PYTHONPATH=src:.``), not pytest. Several ranks share the one GPU,
each with its own ``NCCL_HOSTID`` (NCCL then connects them over its socket transport, so
bandwidths are the transport's; the ratios compare like with like). Prints one table:

- the contract scenarios (``tests/pg/nccl_scenarios.py``): kill + reconfigure in place;
  freeze + abort (the wait raises, a guard buffer never changes after ``abort()`` returned);
- abort latency with a frozen peer (from the freeze scenario);
- all-reduce cost, ftc10d's NCCL group vs a raw ``ProcessGroupNCCL`` in the same processes,
  alternating blocks, median of the per-round ratios (16 and 64 MiB);
- reconfigure + first all-reduce vs a fresh raw ``ProcessGroupNCCL`` + its first all-reduce.

- training on a two-channel group (issue 27, ``benchmarks/_gpu_training.py``): the demo's DDP job
  (3 ranks) and its 2x2 FT-HSDP job under ``ftc10d launch`` over ``cpu:gloo,cuda:nccl`` with the
  model on the GPU, a rank SIGKILLed and one frozen past the heartbeat: completed, replicas
  identical, longest pause, first commit after each fault.

    PYTHONPATH=src:. python benchmarks/gpu_check.py [--rounds 7] [--json out.json] [--no-training]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import Any

sys.path[:0] = [p for p in (os.path.join(os.path.dirname(__file__), "..", "src"),
                            os.path.join(os.path.dirname(__file__), "..")) if p not in sys.path]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _common as c  # noqa: E402

WORLD = 2
SIZES = (16 << 20, 64 << 20)


def _raw_nccl(store: dist.Store, rank: int, tag: str) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=60)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(tag, store), rank, WORLD, opts)
    return pg


def _bench(rank: int, world: int, port: int, rounds: int) -> dict:
    import ftc10d

    os.environ["NCCL_HOSTID"] = f"ftc10d-gpu-check-{rank}"
    torch.cuda.set_device(0)
    store = c.client_store(port)
    ours = ftc10d.ProcessGroup(store, -1, 0, backend="nccl", enable_reconfigure=True)
    handles = c.exchange(store, "h", rank, world, ours.get_reconfigure_handle())
    ftc10d.reconfigure(1, handles, group=ours)
    raw = _raw_nccl(store, rank, "raw")
    out: dict[str, Any] = {"ratio": {}, "ms": {}}
    for size in SIZES:
        t = torch.ones(size // 4, device="cuda")
        for g in (raw, ours):  # warm-up: connections, buffers
            g.allreduce([t]).wait()
        torch.cuda.synchronize()
        ratios, ms = [], {"raw": [], "ftc10d": []}
        for k in range(rounds):
            took = {}
            for name, g in (("raw", raw), ("ftc10d", ours)) if k % 2 == 0 else (("ftc10d", ours), ("raw", raw)):
                c.store_barrier(store, f"b{size}-{k}-{name}", world)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    g.allreduce([t]).wait()
                torch.cuda.synchronize()
                took[name] = (time.perf_counter() - t0) / 5
                ms[name].append(took[name] * 1e3)
            ratios.append(took["ftc10d"] / took["raw"])
        out["ratio"][size] = c.median(ratios)
        out["ms"][size] = {k: c.median(v) for k, v in ms.items()}
    # reconfigure + first all-reduce vs a fresh raw communicator + its first all-reduce
    t = torch.ones(1 << 20, device="cuda")
    fresh, reconf = [], []
    for k in range(3):
        c.store_barrier(store, f"fresh{k}", world)
        t0 = time.perf_counter()
        g = _raw_nccl(store, rank, f"fresh{k}")
        g.allreduce([t]).wait()
        torch.cuda.synchronize()
        fresh.append(time.perf_counter() - t0)
        if hasattr(g, "shutdown"):
            g.shutdown()
        c.store_barrier(store, f"reconf{k}", world)
        t0 = time.perf_counter()
        ftc10d.reconfigure(2 + k, handles, group=ours)
        ours.allreduce([t]).wait()
        torch.cuda.synchronize()
        reconf.append(time.perf_counter() - t0)
    out["fresh_s"], out["reconfigure_s"] = c.median(fresh), c.median(reconf)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--no-training", action="store_true", help="skip the two training jobs (issue 27)")
    args = p.parse_args()
    from ftc10d.pg.nccl import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"gpu-check: skipped: {why}")
        return 0
    from tests.pg import nccl_scenarios as sc

    rows: list[list[Any]] = []
    failed = False
    frozen: dict = {}
    for name, run, check in (("kill, then reconfigure in place", sc.run_kill, sc.check_kill),
                             ("freeze + abort, guard buffer", sc.run_frozen, sc.check_frozen)):
        t0 = time.monotonic()
        try:
            res = run()
            problems = check(res)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            res, problems = {}, [f"{type(exc).__name__}: {exc}"]
        failed |= bool(problems)
        rows.append([name, "PASS" if not problems else "FAIL: " + "; ".join(problems)[:200],
                     f"{time.monotonic() - t0:.1f} s"])
        if run is sc.run_frozen:
            frozen = res
    if frozen:
        rows.append(["abort latency, frozen peer", f"{max(frozen[r]['abort_s'] for r in (0, 1)) * 1e3:.1f} ms", ""])
    bench = c.run(_bench, WORLD, args.rounds, timeout=300)[0]
    for size in SIZES:
        ms = bench["ms"][size]
        rows.append([f"all-reduce {c.fmt_size(size)}: ftc10d / raw ProcessGroupNCCL", f"{bench['ratio'][size]:.3f}x",
                     f"{ms['ftc10d']:.2f} vs {ms['raw']:.2f} ms"])
    rows.append(["reconfigure + first all-reduce / fresh raw communicator + first all-reduce",
                 f"{bench['reconfigure_s'] / bench['fresh_s']:.2f}x",
                 f"{bench['reconfigure_s'] * 1e3:.0f} vs {bench['fresh_s'] * 1e3:.0f} ms"])
    if not args.no_training:
        from benchmarks._gpu_training import run_jobs

        training, bad = run_jobs("cpu:gloo,cuda:nccl", "cuda")
        rows += training
        failed |= bad
    print(f"ftc10d gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {WORLD} ranks on one GPU")
    print(c.table(["check", "result", "detail"], rows))
    c.dump_json(args.json, {"rows": rows, "bench": bench})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

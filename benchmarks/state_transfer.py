"""Live state recovery throughput: ftc10d's transfer vs a raw Gloo broadcast of the same bytes.

What a joiner waits for: the source sends its state (model + Adam state: three
float32 tensors per parameter) over the group: a skeleton, then big tensors
straight from their memory; the joiner (its own model, an optimizer with no
state yet) receives its model's tensors in place and the rest into one buffer,
and loads them into its model and optimizer. Baseline: ``ProcessGroupGloo.broadcast`` of one uint8
tensor of the same byte count between the same ranks (what the transfer would
cost with no packing, framing or loading at all).

Two shapes: 2 ranks (one joiner: point-to-point send/recv) and 4 ranks with
three fresh ranks (broadcast). Sizes are the parameter counts of an MLP; the
bytes moved are ~3x that (weights + exp_avg + exp_avg_sq, float32).

    python benchmarks/state_transfer.py [--params 2M,16M] [--trials 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    client_store,
    dump_json,
    gloo_backend,
    machine,
    median,
    run,
    store_barrier,
    table,
)

TARGET = 0.8


def _model(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # materialize Adam's state
    return model, opt


def worker(rank: int, world: int, port: int, params: int, trials: int, fresh: list[int]) -> dict[str, Any]:
    import ftc10d
    from ftc10d.train.recovery import Plan, transfer

    torch.set_num_threads(1)
    store = client_store(port)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("ftc10d", store), rank, world, timeout=timedelta(seconds=120))
    raw = gloo_backend(dist.PrefixStore("raw", store), rank, world, timedelta(seconds=120))
    model, opt = _model(params)
    plan = Plan(source=0, recipients=fresh, step=0)

    def get_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    ours, base, nbytes = [], [], 0
    for t in range(trials + 1):  # the first round warms both paths
        if rank in fresh:  # a joiner: its own model, a fresh optimizer with no state yet
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        store_barrier(store, f"a{t}", world)
        t0 = time.perf_counter()
        state, moved, _ = transfer(pg, plan, get_state, get_state if rank in fresh else None)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        store_barrier(store, f"b{t}", world)  # the transfer is done when the last joiner loaded it
        ours.append(time.perf_counter() - t0)
        nbytes = max(nbytes, moved)
        buf = torch.empty(nbytes if rank == 0 else 0, dtype=torch.uint8)
        size = torch.tensor([buf.numel()], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        raw.broadcast([size], opts).wait()
        if rank != 0:
            buf = torch.empty(int(size), dtype=torch.uint8)
        store_barrier(store, f"c{t}", world)
        t0 = time.perf_counter()
        if world == 2:
            (raw.send([buf], 1, 7) if rank == 0 else raw.recv([buf], 0, 7)).wait()
        else:
            raw.broadcast([buf], opts).wait()
        store_barrier(store, f"d{t}", world)
        base.append(time.perf_counter() - t0)
    return {"ours": ours[1:], "base": base[1:], "bytes": nbytes}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="2M,16M", help="parameter counts (M = 2**20)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, out = [], []
    for text in args.params.split(","):
        params = int(float(text.rstrip("M")) * 2**20) if text.endswith("M") else int(text)
        for world, fresh in ((2, [1]), (4, [1, 2, 3])):
            res = run(worker, world, params, args.trials, fresh)[0]
            ours, base = median(res["ours"]), median(res["base"])
            ratio = base / ours  # throughput ratio: same bytes
            mb = res["bytes"] / 2**20
            rows.append([f"{params / 2**20:g}M params", world, f"{'p2p' if world == 2 else 'broadcast'}",
                         f"{mb:.0f} MiB", f"{ours * 1000:.0f}", f"{base * 1000:.0f}",
                         f"{mb / ours:.0f}", f"{mb / base:.0f}", f"{ratio:.2f}x",
                         "met" if ratio >= TARGET else "MISSED"])
            out.append({"params": params, "world": world, "bytes": res["bytes"], "ours_s": res["ours"],
                        "base_s": res["base"], "ratio": ratio})
    print(f"live state recovery: pack + send + unpack + load_state_dict (model + Adam) vs raw Gloo of the same "
          f"bytes; medians of {args.trials}; {machine()}")
    print(table(["state", "ranks", "path", "bytes", "ftc10d ms", "raw Gloo ms", "ftc10d MiB/s", "raw MiB/s",
                 "throughput ratio", f"target >= {TARGET}x"], rows))
    dump_json(args.json, {"rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())

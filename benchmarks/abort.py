"""Latency from ``abort()`` to the pending ``wait()`` raising, with a peer frozen by SIGSTOP.

The case abort exists for: a peer is frozen (not dead: its sockets stay open,
so no error ever arrives) and the survivors' collective hangs. Each trial:
all ranks are connected and warm; the last rank announces itself and SIGSTOPs
itself; the survivors issue an allreduce that cannot complete; after ~200 ms a
thread on each survivor calls ``pg.abort()``; the main thread, blocked in
``wait()``, records when it raises. Latency = raise time - abort call time
(same process, same clock). Then the parent SIGCONTs the frozen rank and all
ranks reconfigure to a fresh uuid for the next trial.

Native side (torch >= 2.14): the same with torch's own ``ProcessGroupGloo`` and
its ``abort()``, both a plain group ("native") and one in torch 2.14's
reconfigure regime ("native-reconf"), with a bounded wait: if ``wait()`` has
not returned 5 s after ``abort()``, the trial is reported as "did not return
within 5 s" (the stuck wait is abandoned and the worker exits at the end).

    python benchmarks/abort.py [--ranks 4] [--trials 9] [--native-trials 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    HAS_NATIVE_RECONFIGURE,
    client_store,
    dump_json,
    exchange,
    gloo_backend,
    machine,
    percentile,
    start,
    store_barrier,
    table,
    wait_stopped,
)

TARGET_MS = 50.0
ABORT_AFTER_S = 0.2
NATIVE_BOUND_S = 5.0
#: "native": a plain ProcessGroupGloo; "native-reconf": one in torch 2.14's reconfigure regime.
NATIVE_KINDS = ("native", "native-reconf")


def _freeze_self(store: dist.Store, key: str) -> None:
    """Tell the parent we are about to stop, then stop; resumes on the parent's SIGCONT."""
    store.set(key, str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _hung_trial(store: dist.Store, name: str, allreduce: Callable[[torch.Tensor], Any],
                abort: Callable[[], None], bound_s: float) -> dict[str, Any]:
    """Survivor side of one trial: block in wait(), abort from a thread, time the raise."""
    store.wait([f"{name}/frozen"])  # the frozen rank has (almost) stopped; it never issues this op
    t = torch.ones(1024)
    work = allreduce(t)
    stamps: dict[str, float] = {}

    def aborter() -> None:
        time.sleep(ABORT_AFTER_S)
        stamps["call"] = time.perf_counter()
        abort()
        stamps["returned"] = time.perf_counter()

    def waiter() -> None:
        try:
            work.wait()
            stamps["outcome_ok"] = 1.0
        except BaseException as exc:  # what we wait for
            stamps["error"] = 1.0
            waiter_exc.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        stamps["raised"] = time.perf_counter()

    waiter_exc: list[str] = []
    a = threading.Thread(target=aborter, daemon=True)
    w = threading.Thread(target=waiter, daemon=True)  # so a native wait that never returns can be abandoned
    w.start()
    a.start()
    a.join(ABORT_AFTER_S + bound_s)  # abort() itself may block
    if "call" in stamps:
        w.join(max(0.0, stamps["call"] + bound_s - time.perf_counter()))
    out: dict[str, Any] = {
        "abort_returned_ms": (stamps["returned"] - stamps["call"]) * 1e3 if "returned" in stamps else None,
        "raise_ms": (stamps["raised"] - stamps["call"]) * 1e3 if "raised" in stamps and "call" in stamps else None,
        "raised": "error" in stamps,
        "completed_ok": "outcome_ok" in stamps,
        "exception": waiter_exc[0] if waiter_exc else None,
    }
    return out


def worker(rank: int, world: int, port: int, trials: int, native_trials: int) -> dict[str, Any]:
    import ftc10d

    store = client_store(port)
    frozen = world - 1
    timeout = timedelta(seconds=60)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("ftc10d", store), rank, world, timeout=timeout, enable_reconfigure=True)
    results: dict[str, Any] = {"ftc10d": [], **{k: [] for k in NATIVE_KINDS}}
    warm = torch.ones(1024)

    for trial in range(trials):
        name = f"ftc10d/{trial}"
        hs = exchange(store, name, rank, world, pg.get_reconfigure_handle())
        ftc10d.reconfigure(10_000 + trial, hs, group=pg)
        pg.allreduce([warm]).wait()  # connected and warm
        store_barrier(store, name, world)
        if rank == frozen:
            _freeze_self(store, f"{name}/frozen")
            continue  # resumed by the parent after the survivors are done
        res = _hung_trial(store, name, lambda t: pg.allreduce([t]), pg.abort, bound_s=30.0)
        results["ftc10d"].append(res)
        store.add(f"{name}/done", 1)

    for kind in NATIVE_KINDS if native_trials else ():
        for trial in range(native_trials):
            name = f"{kind}/{trial}"
            nat = _native_group(store, name, rank, world, reconfigure=kind == "native-reconf")
            nat.allreduce([warm]).wait()
            store_barrier(store, name, world)
            if rank == frozen:
                _freeze_self(store, f"{name}/frozen")
            else:
                res = _hung_trial(store, name, lambda t: nat.allreduce([t]), nat.abort, bound_s=NATIVE_BOUND_S)
                results[kind].append(res)
                store.set(f"{name}/stuck/{rank}", "0" if res["raised"] or res["completed_ok"] else "1")
                store.add(f"{name}/done", 1)
            if _native_stuck(store, name, world):
                break  # a wait is still stuck in a thread of ours: report once, do not pile up more
    return results


def _native_group(store: dist.Store, name: str, rank: int, world: int, reconfigure: bool) -> Any:
    """A fresh torch Gloo group per trial (an aborted one is not reusable): plain, or in
    torch 2.14's reconfigure regime (created with enable_reconfigure, then reconfigured)."""
    timeout = timedelta(seconds=60)
    if not reconfigure:
        return gloo_backend(dist.PrefixStore(name, store), rank, world, timeout)
    from torch._C._distributed_c10d import ReconfigureOptions

    nat = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, timeout, True)
    o = ReconfigureOptions()
    o.uuid = 1 + int(name.rsplit("/", 1)[1])
    o.handles = exchange(store, f"{name}/handles", rank, world, nat.get_reconfigure_handle())
    o.timeout = timeout
    nat.reconfigure(o).wait()
    return nat


def _native_stuck(store: dist.Store, name: str, world: int) -> bool:
    """Whether any survivor's wait() did not return in the native trial ``name`` (blocks until all said)."""
    keys = [f"{name}/stuck/{r}" for r in range(world - 1)]
    store.wait(keys)
    return any(v == b"1" for v in store.multi_get(keys))


def _parent_loop(job: Any, world: int, trials: int, native_trials: int) -> None:
    """Resume the frozen rank after each trial (it cannot resume itself)."""
    frozen = world - 1
    store = job.store
    plan = [f"ftc10d/{t}" for t in range(trials)]
    plan += [f"{k}/{t}" for k in NATIVE_KINDS for t in range(native_trials)]

    def until(cond: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + 120
        while not cond():
            if time.monotonic() > deadline or any(p.exitcode is not None for p in job.procs):
                return False  # a rank died: collect() will report it
            time.sleep(0.005)
        return True

    skip: set[str] = set()
    for name in plan:
        kind = name.split("/")[0]
        if kind in skip:
            continue
        if not until(lambda: store.check([f"{name}/frozen"])):
            return
        wait_stopped(job.pid(frozen))
        if not until(lambda: int(store.add(f"{name}/done", 0)) >= world - 1):
            return
        os.kill(job.pid(frozen), signal.SIGCONT)
        if kind in NATIVE_KINDS and _native_stuck(store, name, world):
            skip.add(kind)  # the workers stop this kind after a stuck trial too


def _stats(samples: list[Optional[float]]) -> dict[str, Any]:
    got = [s for s in samples if s is not None]
    return {
        "n": len(samples),
        "returned": len(got),
        "p50_ms": percentile(got, 50) if got else None,
        "p90_ms": percentile(got, 90) if got else None,
        "max_ms": max(got) if got else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--trials", type=int, default=9, help="ftc10d trials (each: freeze, hang, abort, resume)")
    ap.add_argument("--native-trials", type=int, default=2,
                    help="native Gloo trials per kind (torch >= 2.14); a kind stops after its first hung trial")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    native_trials = args.native_trials if HAS_NATIVE_RECONFIGURE else 0

    t0 = time.perf_counter()
    job = start(worker, args.ranks, args.trials, native_trials)
    try:
        _parent_loop(job, args.ranks, args.trials, native_trials)
        res = job.collect(timeout=300)
    finally:
        job.close()
    wall = time.perf_counter() - t0

    survivors = [r for r in range(args.ranks - 1)]
    flat: dict[str, list[dict[str, Any]]] = {
        impl: [t for r in survivors for t in res[r][impl]] for impl in ("ftc10d", *NATIVE_KINDS)
    }
    summary: dict[str, Any] = {}
    for impl, trials in flat.items():
        if not trials:
            continue
        summary[impl] = {
            "raise": _stats([t["raise_ms"] for t in trials]),
            "abort_returned": _stats([t["abort_returned_ms"] for t in trials]),
            "raised": sum(t["raised"] for t in trials),
            "exceptions": sorted({t["exception"] for t in trials if t["exception"]}),
            "trials": trials,
        }

    def cell(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = []
    for impl in ("ftc10d", *NATIVE_KINDS):
        if impl not in summary:
            continue
        s = summary[impl]
        r = s["raise"]
        n_trials = r["n"] // len(survivors)
        if r["returned"] == r["n"]:
            lat = [cell(r["p50_ms"]), cell(r["p90_ms"]), cell(r["max_ms"])]
        elif r["returned"] == 0:
            bound = NATIVE_BOUND_S if impl in NATIVE_KINDS else 30.0
            lat = [f"did not return within {bound:g} s", "-", "-"]
        else:
            lat = [cell(r["p50_ms"]) + f" ({r['returned']}/{r['n']} returned)", cell(r["p90_ms"]), cell(r["max_ms"])]
        verdict = "met" if r["returned"] == r["n"] and (r["max_ms"] or 1e9) <= TARGET_MS else (
            "met (p50)" if r["p50_ms"] is not None and r["p50_ms"] <= TARGET_MS and r["returned"] == r["n"]
            else "MISSED")
        ab = s["abort_returned"]
        rows.append([impl, f"{n_trials} x {len(survivors)}", *lat, cell(ab["p50_ms"]) if ab["returned"] else "-",
                     f"{s['raised']}/{r['n']}", f"<= {TARGET_MS:g} ms", verdict if impl == "ftc10d" else "-"])
    print(f"abort: {args.ranks} ranks, rank {args.ranks - 1} frozen by SIGSTOP, abort() ~{ABORT_AFTER_S * 1e3:.0f} ms "
          f"into a hung allreduce (4 KiB); latency = abort() call -> wait() raises, per survivor; "
          f"{machine()}; {wall:.0f} s")
    print(table(["impl", "trials x survivors", "p50 ms", "p90 ms", "max ms", "abort() returned p50 ms",
                 "wait() raised", "target", "verdict"], rows))
    for impl in summary:
        if summary[impl]["exceptions"]:  # one example; they differ only in rank and uuid
            print(f"  {impl} wait() raised, e.g.: {summary[impl]['exceptions'][0]}")
    if not native_trials:
        print("native Gloo comparison: unavailable (torch < 2.14).")
    dump_json(args.json, {"benchmark": "abort", "machine": machine(), "ranks": args.ranks, "wall_s": wall,
                          "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())

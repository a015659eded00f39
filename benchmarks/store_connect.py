"""TCPStore connects with torch's reverse DNS lookups vs without (``store_connect.py``).

Why it matters: after a store restart every process of a job reconnects, and the next
rendezvous waits for the slowest connect. torch's client and server make a reverse DNS
lookup per connect; where the nameserver drops a query now and then, that connect (or the
server's whole event loop) waits out the resolver's 5-s timeout. ftc10d turns those
lookups off in its processes (finding 37 of docs/reliability.md).

For each mode, a store server process and a client process (both with the mode):
``torch`` (``FTC10D_REVERSE_DNS=1``: torch's lookups kept) and ``ftc10d`` (the default:
off). The client makes ``--connects`` connects one after another, then ``--rounds``
bursts of ``--burst`` connects at once (threads: a job reconnecting after a restart; the
time until the last one connected), while a bystander connection sets a key every 10 ms
(its longest wait shows the server's event loop stalling for everyone). Prints each mode's
figures and the ratio ftc10d / torch.

    python benchmarks/store_connect.py [--connects 200] [--burst 12] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Optional


def _serve(port_file: str) -> int:
    import torch.distributed as dist

    from ftc10d.store_connect import skip_reverse_dns

    skip_reverse_dns()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.port))
    os.replace(port_file + ".tmp", port_file)
    sys.stdin.read()  # until the parent closes it
    return 0


def _client(port: int, connects: int, burst: int, rounds: int) -> int:
    from ftc10d.store_connect import connect_client, skip_reverse_dns

    state = skip_reverse_dns()
    timeout = timedelta(seconds=30)
    bystander = connect_client("127.0.0.1", port, timeout)
    waits: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            t = time.monotonic()
            bystander.set("k", "v")
            waits.append(time.monotonic() - t)
            time.sleep(0.01)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    single = []
    for _ in range(connects):
        t = time.monotonic()
        client = connect_client("127.0.0.1", port, timeout)
        single.append(time.monotonic() - t)
        del client
    lasts = []
    for _ in range(rounds):
        t0 = time.monotonic()
        done: list[float] = []

        def one() -> None:
            connect_client("127.0.0.1", port, timeout)
            done.append(time.monotonic())

        threads = [threading.Thread(target=one) for _ in range(burst)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        lasts.append(max(done) - t0)
    stop.set()
    ticker.join()
    print(json.dumps({"state": state, "single": single, "lasts": lasts, "bystander_max": max(waits)}))
    return 0


def _run_mode(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if mode == "torch":
        env["FTC10D_REVERSE_DNS"] = "1"
    else:
        env.pop("FTC10D_REVERSE_DNS", None)
    port_file = f"/tmp/ftc10d-store-connect-{os.getpid()}-{mode}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file], env=env, stdin=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(port_file):
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        out = subprocess.run([sys.executable, __file__, "--client", str(port), "--connects", str(args.connects),
                              "--burst", str(args.burst), "--rounds", str(args.rounds)],
                             env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait()
        os.unlink(port_file)


def _row(name: str, ts: list[float]) -> str:
    s = sorted(ts)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return (f"  {name:28s} n={len(s):4d}  median {statistics.median(s) * 1000:8.2f} ms  p99 {p99 * 1000:8.1f} ms  "
            f"max {s[-1] * 1000:8.1f} ms  over 1 s: {sum(t > 1.0 for t in s)}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connects", type=int, default=200)
    ap.add_argument("--burst", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return _serve(args.serve)
    if args.client:
        return _client(args.client, args.connects, args.burst, args.rounds)
    results = {}
    for mode in ("torch", "ftc10d"):
        r = results[mode] = _run_mode(mode, args)
        print(f"{mode} (reverse DNS {'kept' if mode == 'torch' else r['state']}):")
        print(_row("one connect", r["single"]))
        print(_row(f"{args.burst} at once, the last", r["lasts"]))
        print(f"  bystander's longest set: {r['bystander_max'] * 1000:.1f} ms")
    t, f = results["torch"], results["ftc10d"]
    print(f"ftc10d / torch: one connect max {max(f['single']) / max(t['single']):.4f}, "
          f"burst median {statistics.median(f['lasts']) / statistics.median(t['lasts']):.3f}, "
          f"burst max {max(f['lasts']) / max(t['lasts']):.4f}, "
          f"bystander max {f['bystander_max'] / t['bystander_max']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

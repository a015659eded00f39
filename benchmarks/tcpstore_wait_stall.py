"""Reproducer: torch's TCPStore delays waiters whose earlier waits timed out on the client.

N clients (one connection each) wait for one key in slices of ``--slice`` seconds
(re-waiting after each client-side timeout), the key is created with
``compare_set`` after ``--delay`` seconds, and the time from the create to each
waiter's return is reported, for three keys in a row. On this machine, with 128
clients, 1 s slices and a 2.5 s delay, the first key's waiters return after
~9 s instead of ~5 ms; with slices longer than the delay (no client-side
timeout before the create) they return in milliseconds. This is what makes the
membership scale benchmark's simulated watchers (which wait in 5 s slices)
see a new configuration seconds late at 1,024+ members, while a probe watcher
sees it in tens of milliseconds (docs/benchmarks.md, membership scale).

    python benchmarks/tcpstore_wait_stall.py [--clients 128] [--slice 1] [--delay 2.5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--slice", type=float, default=1.0, help="client-side wait timeout, seconds")
    ap.add_argument("--delay", type=float, default=2.5, help="seconds between the waits starting and the create")
    args = ap.parse_args(argv)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", master.port, is_master=False) for _ in range(args.clients)]
    for trial in range(3):
        key = f"key{trial}"
        woke: list[float] = [0.0] * args.clients

        def waiter(i: int) -> None:
            while True:
                try:
                    clients[i].wait([key], timedelta(seconds=args.slice))
                    woke[i] = time.monotonic()
                    return
                except dist.DistStoreError:
                    continue  # a slice expired: wait again

        threads = [threading.Thread(target=waiter, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.delay)
        t0 = time.monotonic()
        master.compare_set(key, "", "v")
        for t in threads:
            t.join()
        lat = sorted((w - t0) * 1000 for w in woke)
        print(f"{args.clients} waiters, {args.slice:g} s slices, create after {args.delay:g} s, key {trial}: "
              f"median {lat[len(lat) // 2]:.1f} ms, max {lat[-1]:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

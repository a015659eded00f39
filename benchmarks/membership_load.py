"""The store's load in steady state: one member per rank vs one member per node (node agents).

``N`` "nodes", each a process holding ``R`` real :class:`ftc10d.membership.Member`s
(fake handles: the data path is not the subject) on one real coordinator
TCPStore. Per rank (``--membership-unit rank``): every member heartbeats, polls
for the next configuration and reads its ring successors' heartbeats itself. Per
node (the default under ``ftc10d launch``): each node process also runs a real
:class:`ftc10d.membership.NodeAgent`, its members link to it over its Unix
socket, and only the agent talks to the store for the node.

Measured: every request the processes' membership clients make
(``ftc10d.membership.tcp.requests_made``: one count per round trip) over a
window of steady state, after every member holds the same configuration. Both
modes run in the same invocation, alternating, ``--runs`` times each; the table
shows the medians and the ratio. The coordinator runs as under ``ftc10d launch``: its
detector on (one multi-get of every heartbeat unit per ``timeout / 40``; node agents then
read their ring every ``timeout / 4`` only) and its notifier (one poll per 20 ms for the
whole job, pushing each new record to the agents). Its requests are the *job-wide* column,
apart from the per-node figure: they do not grow with the nodes (one request per tick,
whatever the key count), so at 4 nodes they are a quarter each, at 4,096 nothing.

    python benchmarks/membership_load.py [--nodes 4] [--ranks 8] [--window 5] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import client_store, dump_json, machine, median, start, table  # noqa: E402


def node_process(rank: int, world: int, port: int, coord: tuple[str, int], mode: str, ranks: int,
                 window: float) -> dict[str, Any]:
    """One node: ``ranks`` members (and, in node mode, their agent); returns its request rate."""
    from ftc10d.membership import Member, NodeAgent, TCPMembershipStore
    from ftc10d.membership.store import requests_made

    control = client_store(port)
    store = TCPMembershipStore(*coord)
    agent = NodeAgent(store.clone(), heartbeat_timeout=1.0).start() if mode == "node" else None
    members = [Member(store.clone(), f"ftc10d/v1/bench/{rank}/{i}", heartbeat_timeout=1.0,
                      expected=world * ranks, node_agent=agent.path if agent else None).join()
               for i in range(ranks)]
    for m in members:
        m.wait_next(0, timeout=120)
    size = world * ranks
    deadline = time.monotonic() + 60
    while any((m.current() is None or m.current().size != size) for m in members):
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {rank}: members do not agree on {size}")
        time.sleep(0.05)
    control.set(f"ready/{rank}", "1")
    control.wait(["go"], timedelta(seconds=120))
    time.sleep(1.0)  # settle
    n0, t0 = requests_made(), time.monotonic()
    time.sleep(window)
    n1, t1 = requests_made(), time.monotonic()
    epochs = {m.current().epoch for m in members}
    control.set(f"done/{rank}", "1")
    control.wait(["stop"], timedelta(seconds=120))
    for m in members:
        m.close()
    if agent is not None:
        agent.close()
    return {"rate": (n1 - n0) / (t1 - t0), "epochs": sorted(epochs)}


def one_run(mode: str, nodes: int, ranks: int, window: float) -> dict[str, Any]:
    from ftc10d.membership import Coordinator
    from ftc10d.membership.store import requests_made

    co = Coordinator().start()  # detector and notifier on, as under ftc10d launch
    try:
        job = start(node_process, nodes, (co.host, co.port), mode, ranks, window)
        try:
            job.store.wait([f"ready/{r}" for r in range(nodes)], timedelta(seconds=180))
            job.store.set("go", "1")
            n0, t0 = requests_made(), time.monotonic()  # this process: the coordinator's detector, notifier
            job.store.wait([f"done/{r}" for r in range(nodes)], timedelta(seconds=180))
            coordinator = (requests_made() - n0) / (time.monotonic() - t0)
            job.store.set("stop", "1")
            res = job.collect(timeout=120)
        finally:
            job.close()
    finally:
        co.close()
    members = sum(r["rate"] for r in res.values())  # the nodes' own: agents and ranks
    total = members + coordinator
    epochs = {e for r in res.values() for e in r["epochs"]}
    return {"mode": mode, "total": total, "job_wide": coordinator, "per_node": members / nodes,
            "per_rank": members / (nodes * ranks), "stable": len(epochs) == 1}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--window", type=float, default=5.0, help="seconds measured per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"rank": [], "node": []}
    for _ in range(args.runs):
        for mode in ("rank", "node"):
            runs[mode].append(one_run(mode, args.nodes, args.ranks, args.window))
    rows = []
    med = {}
    for mode in ("rank", "node"):
        r = runs[mode]
        med[mode] = {k: median([x[k] for x in r]) for k in ("total", "job_wide", "per_node", "per_rank")}
        rows.append([f"per {mode}", f"{med[mode]['total']:.0f}", f"{med[mode]['job_wide']:.0f}",
                     f"{med[mode]['per_node']:.1f}", f"{med[mode]['per_rank']:.2f}",
                     "yes" if all(x["stable"] for x in r) else "NO"])
    print(f"store requests/s in steady state: {args.nodes} nodes x {args.ranks} ranks, heartbeat timeout 1 s, "
          f"{args.window:g} s windows, median of {args.runs} runs; {machine()}")
    print(table(["membership", "requests/s", "of which job-wide (coordinator)", "per node (its own)",
                 "per rank (its node's / ranks)", "no change meanwhile"], rows))
    ratio = med["rank"]["per_node"] / max(med["node"]["per_node"], 1e-9)
    print(f"per-node membership: {ratio:.1f}x fewer store requests per node than per-rank "
          f"({med['node']['per_node']:.1f}/s per node, independent of its rank count; plus "
          f"{med['node']['job_wide']:.0f}/s for the whole job)")
    dump_json(args.json, {"args": vars(args), "runs": runs, "median": med, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a node pays for each configuration change at scale: verify a delta record, apply it.

Every node agent (and every per-rank member) does this for every change of the job, on the
path from a rank's exit to every rank holding the next configuration (issue 28's target:
<= 200 ms p99 at 32,768 ranks). The node holds its current configuration with what it
computed for it (its member index, its heartbeat units); per change it verifies the
record's signature, applies the delta, checks the digest, and derives the new
configuration's units and index (what its detector and the next delta need).

The chain: a full record of ``--nodes`` x ``--ranks`` members (ids and handles shaped like a
real job's), then ``--changes`` deltas, each removing one node's ranks and adding a
replacement node's. Each tree given runs in its own process (its own records: the format is
the tree's); prints the median and p90 ms per change and the ratio to the first tree.

    python benchmarks/config_apply.py --tree /path/to/baseline/src --tree src [--nodes 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Optional

CHILD = r"""
import json, secrets, sys, time
from ftc10d.membership.configuration import Configuration, cfg_key
from ftc10d.membership.records import Signer

nodes, ranks, changes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = secrets.SystemRandom(1)

def node_members(n):
    node = secrets.token_hex(8)
    return ([f"{node}.{secrets.token_hex(8)}" for _ in range(ranks)],
            [f"ftc10d/v1/host{n:05d}.cluster.example/{20000 + r}/{secrets.token_hex(8)}" for r in range(ranks)])

members, handles = [], []
for n in range(nodes):
    m, h = node_members(n)
    members += m
    handles += h
signer = Signer(b"job-token")
first = Configuration(epoch=1, uuid=11, handles=tuple(handles), members=tuple(members), incarnation="inc")
records = [signer.encode(cfg_key(1), first.to_body())]
writer = Configuration.from_body(signer.decode(cfg_key(1), records[0]), 1)
for e in range(2, changes + 2):
    gone = set(writer.units[rng.choice(list(writer.units))])
    m, h = node_members(nodes + e)
    keep = [i for i, x in enumerate(writer.members) if x not in gone]
    nxt = Configuration(epoch=e, uuid=10 + e, incarnation="inc",
                        members=tuple(writer.members[i] for i in keep) + tuple(m),
                        handles=tuple(writer.handles[i] for i in keep) + tuple(h))
    records.append(signer.encode(cfg_key(e), nxt.to_body(writer)))
    writer = Configuration.from_body(signer.decode(cfg_key(e), records[-1]), e, writer)
    assert writer is not None
    writer.units

cur = Configuration.from_body(signer.decode(cfg_key(1), records[0]), 1)
cur.units, cur.unit_order, cur.position
times = []
for e in range(2, changes + 2):
    t = time.perf_counter()
    body = signer.decode(cfg_key(e), records[e - 1])
    cfg = Configuration.from_body(body, e, cur)
    assert cfg is not None
    cfg.units, cfg.unit_order, cfg.position
    times.append((time.perf_counter() - t) * 1e3)
    cur = cfg
print(json.dumps({"ms": times, "record_bytes": len(records[-1]), "size": cur.size}))
"""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="a source tree (its src/ dir) to measure")
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--changes", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3, help="runs per tree, alternated")
    args = ap.parse_args(argv)
    per_tree: dict[str, list[float]] = {t: [] for t in args.tree}
    for _ in range(args.runs):
        for tree in args.tree:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.nodes), str(args.ranks), str(args.changes)],
                                 env=env, check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            per_tree[tree] += r["ms"]
    print(f"{args.nodes} nodes x {args.ranks} ranks, {args.changes} changes x {args.runs} runs per tree "
          "(one node's verify + apply + units + index, per change):")
    base = statistics.median(per_tree[args.tree[0]])
    for tree, ms in per_tree.items():
        s = sorted(ms)
        med = statistics.median(s)
        print(f"  {tree:40s} median {med:7.2f} ms  p90 {s[int(0.9 * (len(s) - 1))]:7.2f} ms  "
              f"max {s[-1]:7.2f} ms  ratio to the first {med / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

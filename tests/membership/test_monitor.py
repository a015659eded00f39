"""On etcd, the first two nodes of each configuration watch every heartbeat (monitors).

Real node agents in their own processes on a real etcd, ranks beating them over the real
local channel; faults are real SIGSTOPs. Checked: a silent node is removed at its heartbeat
timeout (not before: its leased heartbeat outlives the timeout; not a read later) by a
monitor; a frozen monitor is removed by the other one; the next configuration's new monitor
takes the role (the last original monitor's silence is then judged by it alone).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ftc10d.membership import Agreement, EtcdMembershipStore, MemberInfo, Signer
from ftc10d.membership.agreement import cfg_key, mem_key, unit_of
from ftc10d.membership.configuration import Configuration
from ftc10d.membership.local import NodeLink
from ftc10d.membership.monitor import MONITORS, monitors_of
from tests.membership.conftest import LastBeat, beat_links, needs_etcd

AGENT = """
import json, sys
from ftc10d.membership import EtcdMembershipStore, NodeAgent
agent = NodeAgent(EtcdMembershipStore(sys.argv[1].split(","), prefix=sys.argv[2]),
                  heartbeat_timeout=float(sys.argv[3])).start()
print(json.dumps({"id": agent.id, "path": agent.path}), flush=True)
sys.stdin.read()
agent.close()
"""


def test_the_monitors_are_the_first_nodes_in_rank_order() -> None:
    ids = [f"{n}.{r}" for n in ("c", "a", "b") for r in range(2)]
    cfg = Configuration(epoch=1, uuid=1, handles=tuple(f"h{i}" for i in range(6)), members=tuple(ids),
                        incarnation="i")
    assert MONITORS == 2 and monitors_of(cfg) == ("c", "a")


@needs_etcd
def test_on_etcd_a_monitor_removes_a_silent_node_at_its_timeout(etcd1: Any) -> None:
    timeout = 4.0
    prefix = f"/mon{time.monotonic_ns()}/"
    endpoints = ",".join(etcd1.endpoints)
    procs = []
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", AGENT, endpoints, prefix, str(timeout)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        procs.append((proc, json.loads(proc.stdout.readline())))
    links: list[tuple[NodeLink, str]] = []
    done = threading.Event()
    try:
        store, signer = EtcdMembershipStore(etcd1.endpoints, prefix=prefix), Signer(None)
        for _, info in procs:
            link = NodeLink(info["path"])
            rs = EtcdMembershipStore(etcd1.endpoints, prefix=prefix)
            rs.borrow_lease(link.lease)  # as a rank under the agent: its records on the node's lease
            for j in range(2):
                mid = f"{info['id']}.{j}"
                rec = MemberInfo(id=mid, handle=f"ftc10d/v1/test/{mid}", host="test", pid=0)
                rs.put(mem_key(mid), signer.encode(mem_key(mid), rec.to_body()), leased=True)
                rs.append_join(mid)
                links.append((link if j == 0 else NodeLink(info["path"]), mid))

        beat_links(links, done)  # the ranks beat their agents (only the agents are frozen)
        cur = Agreement(store, signer, expected=10).propose_first(reason="test").config
        assert cur is not None and cur.size == 10, cur
        time.sleep(timeout + 0.5)  # every node has been seen beating since it was listed
        by_id = {info["id"]: (proc, info) for proc, info in procs}
        first = monitors_of(cur)
        others = [u for u in cur.unit_list if u not in first]
        # A node that is no monitor; then a monitor (removed by the other one); then the other
        # original monitor, whom only the node the last configuration made a monitor can judge
        # at the timeout (the ring's backup reads come every timeout / 4).
        plan = [others[0], first[0], first[1]]
        results = []
        for round_, victim in enumerate(plan):
            mons = monitors_of(cur)
            with LastBeat(lambda: EtcdMembershipStore(etcd1.endpoints, prefix=prefix), victim) as last_beat:
                time.sleep(1.0)
                by_id[victim][0].send_signal(signal.SIGSTOP)
                deadline = time.monotonic() + 4 * timeout
                while not store.exists(cfg_key(cur.epoch + 1)) and time.monotonic() < deadline:
                    time.sleep(0.003)
                removed_at = time.monotonic()
            nxt = Agreement(store, signer).read_config(cur.epoch + 1)
            assert nxt is not None, f"round {round_}: the silent node {victim} was not removed"
            gone = {unit_of(m) for m in cur.members} - {unit_of(m) for m in nxt.members}
            proposer = nxt.reason.split()[1] if nxt.reason.startswith("node ") else nxt.reason
            judge = proposer in mons and proposer != victim and (round_ < 2 or proposer not in first)
            results.append((round_, victim, round(removed_at - last_beat.at, 3), judge, nxt.reason[:80]))
            assert gone == {victim}, (round_, gone, victim, nxt.reason)
            cur = nxt
        # The lower bound is loose for the watcher thread's own scheduling delay; the point is
        # the upper bound (the ring's backup reads every timeout / 4 would be up to 1 s late) and
        # that no removal comes early (a 3-s lease would drop a frozen node's heartbeat at ~3 s).
        print("removals (round, node, s after its last beat, by a monitor, reason):", results)
        assert all(timeout - 0.25 < r[2] < timeout + 0.35 and r[3] for r in results), results
    finally:
        done.set()
        for link, _ in links:
            link.close()
        for proc, _ in procs:
            proc.send_signal(signal.SIGCONT)
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(10)
            except Exception:
                proc.kill()

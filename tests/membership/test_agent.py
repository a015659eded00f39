"""One member per node: ranks that go through a node agent (``ftc10d launch``'s default).

Real ranks (real ProcessGroups allreducing in a loop, recovering through
``Member.sync`` only) linked to real :class:`NodeAgent`s over their Unix
sockets, on a real coordinator TCPStore. Checked: every rank is still listed in
the configuration (under its node's id), the ranks make no store request of
their own in steady state, a frozen rank inside a live node is removed by its
agent (local heartbeat) and fenced when it resumes, and a node that goes silent
(its agent frozen) is removed with all its ranks by the other nodes' ring.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from ftc10d.membership import Coordinator, NodeAgent
from ftc10d.membership.agreement import hb_key, unit_of
from ftc10d.membership.local import FrameBuffer, NodeLink, encode
from ftc10d.types import MembershipError
from tests import harness
from tests.membership.conftest import (LastBeat, beat_links, etcd_spec, needs_etcd, same_config, tcp_spec,
                                       wait_states)
from tests.membership.workers import make_store, pg_worker

AGENT = """
import json, sys
from ftc10d.membership import NodeAgent, TCPMembershipStore
agent = NodeAgent(TCPMembershipStore(sys.argv[1], int(sys.argv[2])), heartbeat_timeout=float(sys.argv[3]),
                  watchers=int(sys.argv[4])).start()
print(json.dumps({"id": agent.id, "path": agent.path}), flush=True)
sys.stdin.read()
agent.close()
"""


def _agent_process(co: Coordinator, timeout: float = 1.0, watchers: int = 2) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT, co.host, str(co.port), str(timeout), str(watchers)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, info


def test_frames_round_trip_and_bad_frames_are_typed_errors() -> None:
    buf = FrameBuffer()
    data = encode({"op": "beat", "n": 1, "id": "a.b"}) + encode({"op": "ack", "n": 1, "ok": True})
    assert buf.feed(data[:7]) == []
    assert buf.feed(data[7:]) == [{"op": "beat", "n": 1, "id": "a.b"}, {"op": "ack", "n": 1, "ok": True}]
    with pytest.raises(MembershipError, match="not JSON"):
        FrameBuffer().feed(b"\x00\x00\x00\x03abc")
    with pytest.raises(MembershipError, match="limit"):
        FrameBuffer().feed(b"\xff\xff\xff\xff")


def test_a_link_to_no_agent_says_how_to_run_without_one(tmp_path: Any) -> None:
    with pytest.raises(MembershipError, match="FTC10D_NODE_AGENT"):
        NodeLink(str(tmp_path / "nothing.sock"))


# `coordinator` (tests/conftest.py) has its detector off: the agents alone find what goes silent.
def test_ranks_of_a_node_are_members_under_its_id_and_make_no_store_requests(coordinator: Coordinator) -> None:
    spec = tcp_spec(coordinator)
    with NodeAgent(coordinator.membership_store(), heartbeat_timeout=1.0) as agent:
        opts = {"expected": 3, "agents": {str(r): agent.path for r in range(3)}}
        job = harness.start(pg_worker, 3, spec, opts)
        try:
            st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, min_steps=5), 60, "3 ranks running")
            assert all(unit_of(s["member"]) == agent.id and s["member"] != agent.id for s in st.values()), st
            assert hb_key(st[0]["member"]) == f"hb/{agent.id}"
            # No heartbeat of a rank's own in the store: only the node's.
            assert not coordinator.membership_store().exists(f"hb/{st[0]['member']}")
            first = {r: (s["requests"], s["t"]) for r, s in st.items()}
            time.sleep(3.0)
            st = wait_states(job.store, [0, 1, 2], lambda s: all(s[r]["t"] > first[r][1] + 2.5 for r in s), 30,
                             "three more seconds of steps")
            rates = {r: (s["requests"] - first[r][0]) / (s["t"] - first[r][1]) for r, s in st.items()}
            # Per rank without an agent: ~50 polls/s for the next configuration, ~40 ring reads/s and
            # 10 heartbeats/s. With one: none (check() asks the store only after a gap in its beats).
            assert all(rate < 1.0 for rate in rates.values()), rates
            assert sorted(agent.local_members()) == sorted(s["member"] for s in st.values())
            job.store.set("test/stop", "1")
            job.collect(timeout=60)
        finally:
            job.close()


def test_a_frozen_rank_in_a_live_node_is_removed_by_its_agent_then_fenced(coordinator: Coordinator) -> None:
    spec = tcp_spec(coordinator)
    with NodeAgent(coordinator.membership_store(), heartbeat_timeout=1.0) as agent:
        opts = {"expected": 3, "rejoin": True, "agents": {str(r): agent.path for r in range(3)}}
        job = harness.start(pg_worker, 3, spec, opts)
        try:
            st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, min_steps=3), 60, "3 ranks running")
            before, frozen = st[0]["uuid"], st[2]["member"]
            job.signal(2, signal.SIGSTOP)
            t0 = time.monotonic()
            st = wait_states(job.store, [0, 1], lambda s: same_config(s, 2, not_uuid=before), 30,
                             "the agent to remove its frozen rank")
            removed_after = time.monotonic() - t0
            shrunk = st[0]["uuid"]
            job.signal(2, signal.SIGCONT)
            st = wait_states(job.store, [0, 1, 2],
                             lambda s: same_config(s, 3, not_uuid=shrunk) and s[2].get("fenced") == 1, 60,
                             "the frozen rank to be fenced, rejoin through its agent and be admitted")
            assert st[2]["member"] != frozen and unit_of(st[2]["member"]) == agent.id
            job.store.set("test/stop", "1")
            results = job.collect(timeout=60)
        finally:
            job.close()
    fenced = [e for e in results[2]["events"] if e[1] == "fenced"]
    assert len(fenced) == 1 and "local-heartbeat" in fenced[0][2], fenced
    assert 0.5 < removed_after < 8, f"removed after {removed_after:.2f} s"


def test_a_silent_node_is_removed_with_all_its_ranks_by_the_others_ring(coordinator: Coordinator) -> None:
    """Three nodes of two ranks; node 1's agent is SIGSTOPped (its ranks live on, unanswered):
    nodes 0 and 2 see its heartbeat lapse and remove both of its ranks; those find out they
    were removed (their beats go unanswered, so they ask the store) and are fenced."""
    spec = tcp_spec(coordinator)
    proc, remote = _agent_process(coordinator)
    try:
        with NodeAgent(coordinator.membership_store(), heartbeat_timeout=1.0) as a0, \
                NodeAgent(coordinator.membership_store(), heartbeat_timeout=1.0) as a2:
            paths = [a0.path, a0.path, remote["path"], remote["path"], a2.path, a2.path]
            opts = {"expected": 6, "agents": {str(r): p for r, p in enumerate(paths)}}
            job = harness.start(pg_worker, 6, spec, opts)
            try:
                st = wait_states(job.store, list(range(6)), lambda s: same_config(s, 6, min_steps=3), 90,
                                 "6 ranks running")
                assert {unit_of(st[r]["member"]) for r in (2, 3)} == {remote["id"]}
                before = st[0]["uuid"]
                proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                wait_states(job.store, [0, 1, 4, 5], lambda s: same_config(s, 4, not_uuid=before), 30,
                            "the other nodes to remove node 1's ranks")
                removed_after = time.monotonic() - t0
                st = wait_states(job.store, [2, 3], lambda s: all(x.get("fenced") == 1 for x in s.values()), 30,
                                 "node 1's ranks to be fenced")
                job.store.set("test/stop", "1")
                results = job.collect([0, 1, 4, 5], timeout=60)
            finally:
                proc.send_signal(signal.SIGCONT)
                job.close()
    finally:
        proc.kill()
        proc.wait()
    finals = {tuple(results[r]["history"][-1][2]) for r in results}
    assert len(finals) == 1, finals
    final = finals.pop()
    assert len(final) == 4 and st[2]["handle"] not in final and st[3]["handle"] not in final, final
    assert 0.5 < removed_after < 8, f"removed after {removed_after:.2f} s"


@pytest.mark.parametrize("notify", [True, False], ids=["hinted", "polling"])
def test_an_agent_learns_each_configuration_from_the_coordinators_hint_or_by_polling(notify: bool) -> None:
    """With the coordinator's notifier the agent reads the chain only when hinted (one poll per
    job); without one (etcd, an older coordinator) it polls. Either way its ranks hold every
    configuration."""
    from ftc10d.membership import Agreement, Member
    from ftc10d.membership.records import Signer

    with Coordinator(detect=False, notify=notify) as co, \
            NodeAgent(co.membership_store(), heartbeat_timeout=1.0) as agent:
        members = [Member(co.membership_store(), f"ftc10d/v1/test/{i}", expected=3, node_agent=agent.path).join()
                   for i in range(3)]
        try:
            first = [m.wait_next(0, timeout=30) for m in members]
            assert {c.epoch for c in first} == {first[0].epoch} and first[0].size == 3
            hints_before = co._notifier.hints if notify else 0
            out = Agreement(co.membership_store(), Signer(None)).report_exit(members[2].handle)
            assert out.config is not None and out.config.size == 2
            t0 = time.monotonic()
            for m in members[:2]:
                assert m.wait_next(first[0].epoch, timeout=10).epoch == out.config.epoch
            took = time.monotonic() - t0
            if notify:
                assert co._notifier.connected >= 1 and co._notifier.hints > hints_before
                assert agent.pushed >= 1  # the record came with its hint: no read per node
            assert took < 5, f"{took:.2f} s"
        finally:
            for m in members:
                m.close()


def test_a_forged_hint_record_is_refused_and_the_real_one_taken() -> None:
    """Anyone can connect to a notifier's port, and a hint's record is pushed, not read: an
    agent must verify it as a stored one. A fake notifier pushes a record for the next epoch
    signed with another key (and one that is not base64): the agent keeps its configuration,
    then takes the real next one when it is written."""
    import socket

    from ftc10d.membership import Agreement, Member
    from ftc10d.membership.agreement import Configuration, cfg_key
    from ftc10d.membership.local import b64
    from ftc10d.membership.notify import NOTIFY_KEY
    from ftc10d.membership.records import Signer

    fake = socket.create_server(("127.0.0.1", 0))
    with Coordinator(detect=False, notify=False, token="real") as co:
        co.membership_store().put(NOTIFY_KEY, str(fake.getsockname()[1]).encode())
        with NodeAgent(co.membership_store(), heartbeat_timeout=1.0, token="real") as agent:
            members = [Member(co.membership_store(), f"ftc10d/v1/test/{i}", expected=2, node_agent=agent.path,
                              token="real").join() for i in range(2)]
            try:
                first = members[0].wait_next(0, timeout=30)
                fake.settimeout(10)
                conn, _ = fake.accept()
                forged = Configuration(epoch=first.epoch + 1, uuid=42, handles=("x",), members=("evil",),
                                       incarnation=first.incarnation)
                raw = Signer("forger").encode(cfg_key(first.epoch + 1), forged.to_body())
                conn.sendall(encode({"op": "hint", "epoch": first.epoch + 1, "raw": b64(raw)})
                             + encode({"op": "hint", "epoch": first.epoch + 1, "raw": "%%%"}))
                time.sleep(1.5)
                deadline = time.monotonic() + 10  # the agent reads the first record itself (no push came)
                while agent.current is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert agent.current is not None and agent.current.epoch == first.epoch
                assert agent.pushed == 0
                out = Agreement(co.membership_store(), Signer("real")).report_exit(members[1].handle)
                assert out.config is not None
                got = members[0].wait_next(first.epoch, timeout=10)
                assert got.epoch == out.config.epoch and got.members == out.config.members
                conn.close()
            finally:
                for m in members:
                    m.close()
    fake.close()


@needs_etcd
def test_on_etcd_the_ranks_records_ride_on_the_nodes_lease(etcd1: Any) -> None:
    """etcd: a rank's leased records (its member record, its join) are on its node agent's lease,
    which the agent renews: a rank that joined long before the last one is still there when the
    first configuration forms (ranks renew no lease of their own), and the job then goes on
    through the loss of a rank."""
    spec = etcd_spec(etcd1)
    with NodeAgent(make_store(spec), heartbeat_timeout=1.0) as agent:
        opts = {"expected": 3, "agents": {str(r): agent.path for r in range(3)}, "hold": {"2": "test/late"}}
        job = harness.start(pg_worker, 3, spec, opts)
        try:
            time.sleep(5.0)  # past the 3-s lease of ranks 0 and 1, had they one of their own
            job.store.set("test/late", "1")
            st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, min_steps=3), 60, "3 ranks running")
            assert {unit_of(s["member"]) for s in st.values()} == {agent.id}
            before = st[0]["uuid"]
            job.signal(1, signal.SIGKILL)
            wait_states(job.store, [0, 2], lambda s: same_config(s, 2, not_uuid=before), 30, "the survivors")
            job.store.set("test/stop", "1")
            job.collect([0, 2], timeout=60)
        finally:
            job.close()


def test_the_coordinator_removes_a_silent_node_at_its_timeout_not_reads_later() -> None:
    """Agents stream each beat to the coordinator's notifier after writing it, and its detector
    judges lapses every 25 ms on what arrived. Judged on its reads of every heartbeat alone (here
    one every 1.4 s at a 3-s timeout), a beat is first seen up to a read late: a silent node went
    up to 1.4 s past the timeout (2.8 s before lapses were judged between reads). Four nodes;
    two agents are SIGSTOPped one after the other (no ring: the coordinator alone detects); each
    removal comes after the timeout, counted from the node's last beat in the store, and less
    than 0.35 s past it."""
    import threading

    from ftc10d.membership import Agreement, MemberInfo, Signer
    from ftc10d.membership.agreement import cfg_key, mem_key

    timeout = 3.0
    with Coordinator(heartbeat_timeout=timeout, watch_interval=1.4) as co:
        procs = [_agent_process(co, timeout=timeout, watchers=0) for _ in range(4)]
        links: list[tuple[NodeLink, str]] = []
        done = threading.Event()
        try:
            store, signer = co.membership_store(), Signer(None)
            for _, info in procs:
                for j in range(2):
                    mid = f"{info['id']}.{j}"
                    rec = MemberInfo(id=mid, handle=f"ftc10d/v1/test/{mid}", host="test", pid=0)
                    store.put(mem_key(mid), signer.encode(mem_key(mid), rec.to_body()))
                    store.append_join(mid)
            # Each rank beats its agent over the real local link (an agent removes a rank of its
            # own that does not), from this process: only the agent processes are frozen below.
            links = [(NodeLink(info["path"]), f"{info['id']}.{j}") for _, info in procs for j in range(2)]

            beat_links(links, done)
            cur = Agreement(store, signer, expected=8).propose_first(reason="test").config
            assert cur is not None and cur.size == 8, cur
            time.sleep(timeout + 0.5)  # every node has been seen beating since it was listed
            silences = []
            for victim_proc, victim in (procs[1], procs[2]):
                with LastBeat(co.membership_store, victim["id"]) as last_beat:
                    time.sleep(0.5)
                    victim_proc.send_signal(signal.SIGSTOP)
                    deadline = time.monotonic() + 4 * timeout
                    while not store.exists(cfg_key(cur.epoch + 1)) and time.monotonic() < deadline:
                        time.sleep(0.002)
                    removed_at = time.monotonic()
                nxt = Agreement(store, signer).read_config(cur.epoch + 1)
                assert nxt is not None, "the silent node was not removed"
                gone = {unit_of(m) for m in cur.members} - {unit_of(m) for m in nxt.members}
                assert gone == {victim["id"]} and "coordinator" in nxt.reason, nxt.reason
                silences.append(removed_at - last_beat.at)
                cur = nxt
            # The lower bound is loose: the watcher thread sees the last beat up to a scheduling
            # delay late on a loaded 2-core CI machine (2.949 s was measured there once), which
            # shortens the figure; a detector that judged early (e.g. from its reads) is off by
            # far more. The upper bound is the point: reads alone give 3.43-3.96 s here.
            assert all(timeout - 0.25 < x < timeout + 0.35 for x in silences), \
                f"removed {[round(x, 3) for x in silences]} s after their last beats (timeout {timeout:g} s)"
        finally:
            done.set()
            for link, _ in links:
                link.close()
            for proc, _ in procs:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


def test_streaming_a_beat_never_blocks_on_a_notifier_that_stopped_reading() -> None:
    """A frozen coordinator stops reading its agents' beats: an agent's ``send_beat`` must
    return at once (the beat is in the store already), or its store heartbeat would stop too."""
    import socket

    from ftc10d.membership.notify import HintClient

    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        client = HintClient("127.0.0.1", lst.getsockname()[1])
        peer, _ = lst.accept()  # never reads
        try:
            t0 = time.monotonic()
            for n in range(20000):  # ~2 MB: more than the socket buffers hold
                client.send_beat("a" * 32, f"{n}:{'s' * 64}".encode())
            took = time.monotonic() - t0
            assert took < 10.0, f"20,000 beats took {took:.1f} s: a send blocked"
            assert client.wait(0.01) == []  # the connection still works for hints
        finally:
            client.close()
            peer.close()

"""The stores under faults: a coordinator restart (TCPStore), an etcd member killed,
forged records, quorum, and the majority rule."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from ftc10d.membership import Agreement, Coordinator, Member, Signer
from ftc10d.membership.agreement import cfg_key, hb_key
from tests import harness
from tests.membership.conftest import etcd_spec, needs_etcd, same_config, states, tcp_spec, wait_states
from ftc10d.chaos.etcd import EtcdCluster, free_port
from tests.membership.workers import member_worker, pg_worker


# ------------------------------------------------------------ coordinator restart


def _start_coordinator(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "ftc10d", "coordinator", "--port", str(port), "--no-detect"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the coordinator exited at start")
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the coordinator did not start listening")


@pytest.mark.parametrize("unit", ["rank", "node"])
def test_coordinator_restart_reforms_with_fresh_uuid(unit: str) -> None:
    """The TCPStore keeps its state in memory: when `ftc10d coordinator` is killed and
    restarted, the members notice the new incarnation, rejoin under their ids and
    re-form the same membership with a fresh uuid; their ProcessGroups (whose store
    reconnects too) reconfigure onto it and carry on. ``node``: the ranks go through a node
    agent, which sees the restart and tells them to look at the store's incarnation."""
    from ftc10d.membership import NodeAgent, TCPMembershipStore

    port = free_port("127.0.0.1")
    coord = _start_coordinator(port)
    spec = {"kind": "tcp", "host": "127.0.0.1", "port": port}
    agent = NodeAgent(TCPMembershipStore("127.0.0.1", port)).start() if unit == "node" else None
    opts: dict[str, Any] = {"expected": 3, "pg_store": "coordinator"}
    if agent is not None:
        opts["agents"] = {str(r): agent.path for r in range(3)}
    job = harness.start(pg_worker, 3, spec, opts)
    try:
        st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, min_steps=3), 60, "3 ranks running")
        before_uuid, before_epoch = st[0]["uuid"], st[0]["epoch"]
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait(10)
        time.sleep(0.5)  # members see the store gone (the data path goes on: Gloo does not need it)
        coord = _start_coordinator(port)
        st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, not_uuid=before_uuid), 60,
                         "the members to re-form on the restarted coordinator")
        assert st[0]["epoch"] > before_epoch
        steps = {r: s["steps"] for r, s in st.items()}
        wait_states(job.store, [0, 1, 2], lambda s: all(s[r]["steps"] >= steps[r] + 5 for r in s), 30, "progress")
        job.store.set("test/stop", "1")
        results = job.collect(timeout=60)
    finally:
        job.close()
        if agent is not None:
            agent.close()
        if coord.poll() is None:
            os.killpg(coord.pid, signal.SIGKILL)
            coord.wait(10)
    finals = {tuple(res["history"][-1][:2]) for res in results.values()}
    assert len(finals) == 1
    # A uuid names one epoch only, before and after the restart.
    pairs = {(h[0], h[1]) for res in results.values() for h in res["history"]}
    assert len({u for _, u in pairs}) == len(pairs) >= 2


# ----------------------------------------------------------- etcd: lose one of three


@needs_etcd
def test_etcd_one_of_three_killed_has_no_effect(etcd3: EtcdCluster) -> None:
    spec = etcd_spec(etcd3)
    job = harness.start(pg_worker, 3, spec, {"expected": 3})
    try:
        st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, min_steps=3), 60, "3 ranks running")
        uuid = st[0]["uuid"]
        etcd3.kill(0)  # the endpoint every member talks to first (and perhaps the Raft leader)
        steps = {r: s["steps"] for r, s in st.items()}
        t_end = time.monotonic() + 3.0  # three heartbeat timeouts
        while time.monotonic() < t_end:
            now = states(job.store, [0, 1, 2])
            assert all(s["uuid"] == uuid for s in now.values()), f"membership changed after losing one etcd: {now}"
            time.sleep(0.05)
        wait_states(job.store, [0, 1, 2], lambda s: all(s[r]["steps"] >= steps[r] + 5 and s[r]["uuid"] == uuid
                                                        for r in s), 30, "progress on the same configuration")
        # The two remaining etcd members still agree on a change.
        job.signal(2, signal.SIGKILL)
        wait_states(job.store, [0, 1], lambda s: same_config(s, 2, not_uuid=uuid), 30, "agreement without rank 2")
        job.store.set("test/stop", "1")
        job.collect([0, 1], timeout=60)
    finally:
        job.close()


# ------------------------------------------------------------------ forged records


def test_bad_signature_is_ignored_and_logged(coordinator: Coordinator, caplog: Any) -> None:
    """With a job token, a record signed with another key (or unsigned) is ignored
    and logged: a forged next configuration is not adopted, a forged join is not
    admitted, and the next real proposal takes the forged slot over."""
    caplog.set_level(logging.WARNING, logger="ftc10d")
    token = "job-token-A"
    members = [Member(coordinator.membership_store(), f"ftc10d/v1/t/{i}/{i:016x}", token=token, expected=3).join()
               for i in range(3)]
    try:
        first = [m.wait_next(0, 30) for m in members][0]
        store = coordinator.membership_store()
        forger = Signer("not-the-token")
        # A forged configuration that would evict members 1 and 2.
        forged = forger.encode(cfg_key(first.epoch + 1), {
            "kind": "config", "epoch": first.epoch + 1, "uuid": 12345, "inc": first.incarnation,
            "members": [[members[0].id, members[0].handle]], "joins": first.joins_upto, "min": 1})
        assert store.create(cfg_key(first.epoch + 1), forged)[0]
        # A forged join: a member record and heartbeat signed with the wrong key, and an unsigned one.
        store.put("mem/evil", forger.encode("mem/evil", {"kind": "member", "id": "evil",
                                                         "handle": "ftc10d/v1/x/1/" + "e" * 16}))
        store.put(hb_key("evil"), forger.encode_beat(hb_key("evil"), 1))
        store.append_join("evil")
        store.put("mem/bare", Signer(None).encode("mem/bare", {"kind": "member", "id": "bare",
                                                               "handle": "ftc10d/v1/x/2/" + "b" * 16}))
        store.put(hb_key("bare"), Signer(None).encode_beat(hb_key("bare"), 1))
        store.append_join("bare")
        time.sleep(1.0)
        assert all(m.current().epoch == first.epoch for m in members), "a forged configuration was adopted"
        assert not any(m.fenced for m in members)
        assert any("bad signature" in r.getMessage() for r in caplog.records)
        # A real change now: member 2 leaves. Its proposal replaces the forged slot.
        members[2].close(leave=True)
        nxt = members[0].wait_next(first.epoch, 10)
        assert nxt.epoch == first.epoch + 1 and nxt.uuid != 12345
        assert list(nxt.members) == [members[0].id, members[1].id]  # neither evil nor bare was admitted
        assert members[1].wait_next(first.epoch, 10) == nxt
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "mem/evil" in messages and "missing signature" in messages
    finally:
        for m in members:
            m.close()


# ------------------------------------------------------------------------- quorum


def test_below_min_members_blocks_with_clear_status(coordinator: Coordinator) -> None:
    spec = tcp_spec(coordinator)
    opts = {"expected": 4, "min_members": 4}
    job = harness.start(member_worker, 4, spec, opts)
    joiner = None
    try:
        st = wait_states(job.store, [0, 1, 2, 3], lambda s: same_config(s, 4), 60, "4 members")
        epoch = st[0]["epoch"]
        job.signal(3, signal.SIGKILL)
        st = wait_states(job.store, [0, 1, 2],
                         lambda s: all(v["state"] == "blocked" and "min_members=4" in v["detail"] for v in s.values()),
                         20, "the survivors to report that they are blocked below min_members")
        assert all(v["epoch"] == epoch for v in st.values())
        st = wait_states(job.store, [0, 1, 2], lambda s: all(v["timeout_msg"] for v in s.values()), 20,
                         "wait_next to time out with the status")
        assert "below min_members=4" in st[0]["timeout_msg"]
        time.sleep(1.0)
        assert all(v["epoch"] == epoch for v in states(job.store, [0, 1, 2]).values()), \
            "a configuration formed below quorum"
        # A replacement joins: quorum is back, the dead member is dropped in the same step.
        joiner = harness.start(member_worker, 1, spec, {**opts, "rank_offset": 4}, store=job.store)
        st = wait_states(job.store, [0, 1, 2, 4], lambda s: same_config(s, 4) and s[0]["epoch"] > epoch, 30,
                         "a configuration of 3 survivors and the joiner")
        assert st[0]["state"] == "member"
        assert st[4]["handle"] in st[0]["handles"] and all(v["state"] == "member" for v in st.values())
        job.store.set("test/stop", "1")
        job.collect([0, 1, 2], timeout=30)
        joiner.collect(timeout=30)
    finally:
        job.close()
        if joiner is not None:
            joiner.close()


def _two_halves(coordinator: Coordinator, tag: str) -> tuple[list[Member], Any, str, str, list[Member]]:
    """Four members in one configuration: (members, configuration, its first two member ids,
    the two other members)."""
    members = [Member(coordinator.membership_store(), f"ftc10d/v1/{tag}/{i}/{i:016x}", expected=4, watchers=0).join()
               for i in range(4)]
    cfg = [m.wait_next(0, 30) for m in members][0]
    first, second = cfg.members[0], cfg.members[1]
    return members, cfg, first, second, [m for m in members if m.id not in (first, second)]


def test_majority_rule_and_its_tie_breaker(coordinator: Coordinator) -> None:
    """Removing half the members on suspicion is refused (a partitioned minority could
    otherwise vote the majority out) unless the remaining half holds the configuration's
    first member (the tie-breaker: only one half can). (Confirmed exits need no majority:
    ``test_a_confirmed_exit_needs_no_majority`` and the launcher's tests.)"""
    members, cfg, first, second, others = _two_halves(coordinator, "t")
    try:
        # the half without the first member cannot remove the half with it
        ag = Agreement(coordinator.membership_store(), Signer(None), self_id=others[0].id)
        out = ag.propose({first: "heartbeat", second: "peer-error"}, reason="test")
        assert not out.changed and out.blocked and "no majority" in out.blocked
        assert ag.latest() == cfg
        # nor fewer than half of them, with or without it
        out = ag.propose({first: "heartbeat", second: "heartbeat", others[1].id: "heartbeat"}, reason="test")
        assert not out.changed and out.blocked and "no majority" in out.blocked
    finally:
        for m in members:
            m.close()


def test_the_half_with_the_first_member_removes_the_other_half(coordinator: Coordinator) -> None:
    """The tie-breaker's other side: two halves (two nodes, two FT-HSDP replicas), one gone
    at once without a supervisor to report it; the half holding the configuration's first
    member removes the other on suspicion alone and goes on."""
    members, cfg, first, second, others = _two_halves(coordinator, "h")
    try:
        ag_first = Agreement(coordinator.membership_store(), Signer(None), self_id=first)
        out = ag_first.propose({others[0].id: "heartbeat", others[1].id: "peer-error"}, reason="test")
        assert out.changed and out.config is not None and list(out.config.members) == [first, second], out
        assert next(m for m in members if m.id == first).wait_next(cfg.epoch, 10).size == 2
        with pytest.raises(Exception) as err:
            others[0].wait_next(cfg.epoch, 10)
        assert type(err.value).__name__ == "Fenced"
    finally:
        for m in members:
            m.close()



def test_a_confirmed_exit_needs_no_majority(coordinator: Coordinator) -> None:
    """A removal blocked for want of a majority goes through once a supervisor confirms one
    of the exits: both go in one epoch (2 left of the 3 whose fate is unknown)."""
    members, cfg, first, second, others = _two_halves(coordinator, "c")
    try:
        ag = Agreement(coordinator.membership_store(), Signer(None), self_id=others[0].id)
        out = ag.propose({first: "heartbeat", second: "heartbeat"}, reason="test")
        assert not out.changed and out.blocked and "no majority" in out.blocked
        supervisor = Agreement(coordinator.membership_store(), Signer(None))
        out = supervisor.report_exit(next(m for m in members if m.id == first).handle)
        assert out.changed and out.config is not None and out.config.size == 2, out
        assert sorted(out.config.members) == sorted(m.id for m in others)
        assert not supervisor.report_exit(next(m for m in members if m.id == first).handle).changed  # gone
    finally:
        for m in members:
            m.close()


@needs_etcd
def test_a_record_past_etcds_request_limit_is_a_clear_error() -> None:
    """At ~40,000 ranks a full configuration record (deflated) passes etcd's default
    --max-request-bytes (1.5 MiB): say so, and how to raise it, instead of an opaque etcd error
    (here an etcd started with a 64 KiB limit and a 100 KB record)."""
    from ftc10d.membership import EtcdMembershipStore
    from ftc10d.types import MembershipError

    cluster = EtcdCluster(1, flags=["--max-request-bytes", "65536"]).start()
    try:
        store = EtcdMembershipStore(cluster.endpoints, prefix=f"/big{time.monotonic_ns()}/")
        with pytest.raises(MembershipError, match="--max-request-bytes"):
            store.put("cfg/000000000001", b"x" * 100_000)
        store.put("small", b"ok")  # nothing else broke
        assert store.get("small") == b"ok"
    finally:
        cluster.stop()


@needs_etcd
def test_a_32768_rank_first_configuration_fits_etcds_default_request_limit() -> None:
    """4,096 nodes x 8 ranks with random member ids and handles: ~3.3 MB of JSON, ~1 MB deflated,
    ~1.3 MB base64-encoded in etcd's API: under its default --max-request-bytes (1.5 MiB), so
    such a job forms on a stock etcd (it was refused before records were deflated)."""
    import secrets

    from ftc10d.membership import EtcdMembershipStore
    from ftc10d.membership.configuration import Configuration

    cluster = EtcdCluster(1).start()
    try:
        store = EtcdMembershipStore(cluster.endpoints, prefix=f"/first{time.monotonic_ns()}/")
        writer = Agreement(store, Signer("t"))
        ids = [f"{secrets.token_hex(8)}.{secrets.token_hex(8)}" for _ in range(4096 * 8)]
        handles = [f"ftc10d/v1/node-{i // 8:05d}.cluster.internal/{40000 + i % 8}/{secrets.token_hex(8)}"
                   for i in range(len(ids))]
        cfg = Configuration(epoch=1, uuid=3, handles=tuple(handles), members=tuple(ids),
                            incarnation=writer.incarnation(), full_epoch=1)
        ok, _ = writer._install(cfg, None)
        assert ok
        got = Agreement(EtcdMembershipStore(cluster.endpoints, prefix=store.prefix), Signer("t")).read_config(1)
        assert got is not None and got.members == cfg.members and got.handles == cfg.handles
    finally:
        cluster.stop()


def test_a_removal_never_forms_the_first_configuration_of_an_incarnation(coordinator: Coordinator) -> None:
    """A detector (a node agent's, the coordinator's) that still holds the configuration of a
    store that since lost its state proposes a removal: it must be refused, not turned into a
    first configuration of whoever has joined so far. That formed a 1-member epoch 1 after a
    store restart, below the members' epochs (chaos finding 30): only the members form it."""
    joiner = Member(coordinator.membership_store(), "ftc10d/v1/t/0/0000000000000000", expected=4, watchers=0).join()
    try:
        authority = Agreement(coordinator.membership_store(), Signer(None))  # as the agents and the coordinator
        assert authority.latest() is None
        out = authority.propose({"0123456789abcdef.0123456789abcdef": "heartbeat"}, reason="node x saw ...")
        assert out.config is None and not out.changed and out.blocked and "the members form it" in out.blocked
        assert authority.latest() is None, "a removal formed a configuration"
        out = authority.propose({}, reason="a rendezvous failed", renew_after=3)
        assert out.config is None and authority.latest() is None
    finally:
        joiner.close()

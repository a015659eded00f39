"""The coordinator's notifier fans each new configuration out to the node agents.

Real coordinator (TCPStore + notifier), real NodeAgents over TCP. A job's first configuration
of a big job (a record over ``HINT_RECORD_MAX``) is pushed to every agent, paced
(``FANOUT_WINDOW`` connections at a time), and no agent reads it from the store: 4,096 agents
reading a 1-MB record at once took the store process past 8 GB (OOM-killed).
"""

from __future__ import annotations

import time
from typing import Optional

from ftc10d.membership import Agreement, Coordinator, NodeAgent, Signer, TCPMembershipStore
from ftc10d.membership import notify
from ftc10d.membership.configuration import KEY_START, Configuration, cfg_key
from ftc10d.membership.local import FrameBuffer, unb64


class CountingStore(TCPMembershipStore):
    """Counts the reads of configuration records (shared by an agent's threads on TCP)."""

    reads: list[str] = []

    def get(self, key: str) -> Optional[bytes]:
        if key.startswith("cfg/"):
            CountingStore.reads.append(key)
        return super().get(key)

    def clone(self) -> "CountingStore":
        return CountingStore(self.host, self.port, prefix=self.prefix, timeout=self.timeout)


def test_a_big_first_configuration_is_pushed_to_every_agent_paced_and_not_read_from_the_store(
        monkeypatch: object) -> None:
    import secrets

    monkeypatch.setattr(notify, "FANOUT_WINDOW", 3)  # type: ignore[attr-defined]
    CountingStore.reads = []
    with Coordinator(detect=False, token="t") as co:
        agents = [NodeAgent(CountingStore(co.host, co.port), token="t", heartbeat_timeout=2.0).start()
                  for _ in range(12)]
        try:
            deadline = time.monotonic() + 30
            while co._notifier.connected < len(agents) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert co._notifier.connected == len(agents)
            writer = Agreement(co.membership_store(), Signer("t"))
            # 12 nodes x 400 ranks, ids and handles with random parts as real ones: ~180 KB deflated.
            ids = [f"{a.id}.{secrets.token_hex(8)}" for a in agents for _ in range(400)]
            handles = [f"ftc10d/v1/node-{i // 400:03d}/{40000 + i}/{secrets.token_hex(8)}" for i in range(len(ids))]
            first = Configuration(epoch=1, uuid=11, handles=tuple(handles), members=tuple(ids),
                                  incarnation=writer.incarnation(), full_epoch=1)
            ok, _ = writer._install(first, None)
            assert ok
            start = {"kind": "start", "epoch": 1, "inc": first.incarnation}  # as propose_first writes it
            writer.store.put(KEY_START, writer.signer.encode(KEY_START, start))
            raw = co.membership_store().get(cfg_key(1))
            assert raw is not None and len(raw) > notify.HINT_RECORD_MAX, len(raw or b"")
            CountingStore.reads = []
            deadline = time.monotonic() + 30
            while any(a.current is None for a in agents) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all(a.current is not None and a.current.digest == first.digest for a in agents)
            assert all(a.pushed >= 1 for a in agents), [a.pushed for a in agents]
            assert "cfg/000000000001" not in CountingStore.reads, CountingStore.reads
            assert 1 <= co._notifier.peak_sending_big <= 3, co._notifier.peak_sending_big
            # The next configuration (a small delta) follows the big one, in order, pushed too.
            second = Configuration(epoch=2, uuid=12, handles=tuple(handles[1:]), members=tuple(ids[1:]),
                                   incarnation=first.incarnation, full_epoch=1)
            ok, installed = writer._install(second, first)
            assert ok and installed is not None
            deadline = time.monotonic() + 30
            while any(a.current.epoch < 2 for a in agents) and time.monotonic() < deadline:
                time.sleep(0.02)
            # The delta's digest is chained from the first's; the list is the same as written.
            assert all(a.current.digest == installed.digest for a in agents)
            assert all(a.current.list_digest == second.list_digest for a in agents)
            assert CountingStore.reads == [], CountingStore.reads
        finally:
            for a in agents:
                a.close()


def test_an_agent_that_stops_taking_a_big_record_gives_its_turn_up(monkeypatch: object) -> None:
    """The fan-out's turns are few (``FANOUT_WINDOW``): a frozen agent must not hold one. The
    notifier is driven by hand here (not started) over real sockets: 4 agents' connections,
    window 2, a 3-MB frame; two clients never read. Their turns are taken back after
    ``BIG_TURN_STALL_S`` without progress, and the readers get the whole frame."""
    import selectors
    import socket

    monkeypatch.setattr(notify, "FANOUT_WINDOW", 2)  # type: ignore[attr-defined]
    monkeypatch.setattr(notify, "BIG_TURN_STALL_S", 0.3)  # type: ignore[attr-defined]
    with Coordinator(detect=False, notify=False) as co:
        n = notify.Notifier(co.membership_store(), Signer(None), "127.0.0.1")  # not started
        n._sel = sel = selectors.DefaultSelector()
        clients = []
        for _ in range(4):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(("127.0.0.1", n.port))
            clients.append(c)
        deadline = time.monotonic() + 10
        while n.connected < 4 and time.monotonic() < deadline:
            n._accept(sel)
        assert n.connected == 4
        for s, _ in n._conns.values():
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        by_peer = {s.getpeername(): fd for fd, (s, _) in n._conns.items()}
        fds = [by_peer[c.getsockname()] for c in clients]
        record = bytes(range(256)) * (3_000_000 // 256)
        n._broadcast(7, record)
        # Clients 0 and 1 (first in order) hold the two turns and read nothing; 2 and 3 wait.
        assert n._sending_big == {fds[0], fds[1]} and list(n._big_turns) == [fds[2], fds[3]]
        time.sleep(0.4)
        n._admit()  # no byte taken for 0.4 s: their connections are dropped, the turns move on
        assert fds[0] not in n._conns and fds[1] not in n._conns
        assert n._sending_big == {fds[2], fds[3]}
        got = {2: bytearray(), 3: bytearray()}
        for c in clients[2:]:
            c.setblocking(False)
        deadline = time.monotonic() + 30
        frames = {2: FrameBuffer(), 3: FrameBuffer()}
        msgs: dict[int, list] = {2: [], 3: []}
        while any(not any("raw" in m for m in msgs[i]) for i in (2, 3)) and time.monotonic() < deadline:
            for i in (2, 3):
                try:
                    data = clients[i].recv(1 << 16)
                    got[i] += data
                    msgs[i] += frames[i].feed(data)
                except BlockingIOError:
                    pass
                if fds[i] in n._conns:
                    n._flush(fds[i])
            n._admit()
        for i in (2, 3):
            assert [m.get("follows") for m in msgs[i]] == [True, None], msgs[i]
            assert unb64(msgs[i][1]["raw"]) == record
        assert not n._sending_big and n.peak_sending_big == 2
        for c in clients:
            c.close()
        n.close()

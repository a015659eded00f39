"""Per-node membership at scale: many real node agents, their ranks on the real local channel.

``--nodes`` real :class:`ftc10d.membership.NodeAgent`s (its own threads, its own store
connections, the code ``ftc10d launch`` runs) spread over ``--procs`` processes, each with
``--ranks`` simulated ranks connected to its Unix socket and speaking the real protocol
(hello, heartbeats, configurations received). The store is a real coordinator TCPStore in
its own process (``ftc10d coordinator --no-detect``: the agents' rings are the detection),
or with ``--etcd`` a real single-member etcd. The coordinator detects lapsed heartbeats, as
under ``ftc10d launch`` (one read of every node's heartbeat per ``timeout / 40``; the agents
then read their ring only every ``timeout / 4``); ``--no-coordinator-detect`` leaves detection
to the agents' rings (full pace). On etcd the first two nodes of the configuration are monitors
(an etcd watch of every heartbeat each; the others' rings every ``timeout / 4``);
``--monitors 0`` leaves it to the rings at full pace, as before monitors.

One process hosts many agents, and what a real node does once for itself (decode a new
record: O(ranks) to build the member list and check its digest) such a process does once for
all its agents (:data:`ftc10d.membership.agreement._DECODED`). That per-node cost is measured
on its own and reported beside the figures (a real node adds it, in parallel with the others).

What is simulated, and how it differs from a real job: the ranks are not ``Member``
objects (one per process would be 32,768 processes): each is a socket that heartbeats its
agent every ``--rank-beat`` timeouts (default 1/4; a real rank: every ``timeout / 10``; local
traffic only, the store never sees it) and timestamps each configuration pushed to it (a real rank then also
checks its signature, ~10 us). Every rank is admitted through the real join path (its
``mem/`` record, the join log, ``Agreement.propose_first``). Nothing of the agents is
simplified: they poll, read their ring successors and heartbeat as they do under the launcher.

Measured, each on the same clock (one host, ``time.monotonic``):

- **steady state**: store requests/s (the agents' clients, ``requests_made``), per node;
  the store process's CPU.
- **a rank's exit**: the launcher's ``report_exit`` (confirmed removal), then the time until
  each rank's socket received the next configuration: p50 / p99 / max over every rank.
- **a node's silence**: one agent stops (its heartbeat stops; its ranks' link dies): the
  time from its last heartbeat written (the store's last sight of the node; the stop can
  come up to a beat interval later) until every other rank received the configuration
  without its ranks. Target: the heartbeat timeout + 100 ms.

    python benchmarks/membership_scale.py --nodes 1024 --ranks 8 [--procs 8] [--timeout 1]
        [--poll 0.02] [--etcd] [--json out.json]
"""

from __future__ import annotations

import os

if os.environ.get("FTC10D_SIM_CHILD") == "green":
    # An agents' process hosting them on greenlets (see _Children): patched before anything
    # else is imported, so that every lock, socket and thread the agent code makes is gevent's.
    from gevent import monkey

    monkey.patch_all()

import argparse
import hashlib
import json
import logging
import re
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import client_store, die_with_parent, dump_json, host_store, machine, percentile, table  # noqa: E402
from benchmarks.membership import Etcd, _cpu_seconds, _free_port, _start_coordinator  # noqa: E402


def rank_id(node: str, j: int) -> str:
    """A simulated rank's member id, shaped like a real one (``<node>.<16 random hex>``): the
    records' size and how well they deflate depend on it."""
    return f"{node}.{hashlib.sha256(f'{node}/{j}'.encode()).hexdigest()[:16]}"


def rank_handle(node: str, j: int) -> str:
    """A simulated rank's reconfigure handle, shaped like ``get_reconfigure_handle()``'s
    (``ftc10d/v1/<host>/<pid>/<16 random hex>``), so the first configuration is as big and as
    incompressible as a real job's (~31 bytes per rank deflated, not the ~10 a readable
    ``sim/<node>/<j>`` would give)."""
    nonce = hashlib.sha256(f"handle/{node}/{j}".encode()).hexdigest()[:16]
    return f"ftc10d/v1/node-{node[:6]}.cluster.internal/{30000 + j}/{nonce}"


class _Frames:
    """The local channel's framing (4-byte length + JSON), reading a frame's op and epoch from
    its first bytes and skipping the rest unbuffered: a real rank decodes and verifies every
    record (that cost is measured on its own, ``decode_ms``), but 512 simulated ranks per
    process buffering and parsing a 2.7-MB first configuration each would starve (and, at
    4,096 nodes, exhaust the memory of) the agents they share the machine with."""

    _HEAD = re.compile(rb'\{"op":"(\w+)","epoch":(\d+)')
    _PEEK = 64

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skip = 0  # body bytes of the current frame still to drop
        self._head: tuple[str, Optional[int]] = ("?", None)  # the current frame's, reported at its end

    def feed(self, data: bytes) -> list[tuple[str, Optional[int]]]:
        """The (op, epoch) of each frame whose last byte is in ``data``."""
        out: list[tuple[str, Optional[int]]] = []
        view = memoryview(data)
        while view:
            if self._skip:
                k = min(self._skip, len(view))
                self._skip -= k
                view = view[k:]
                if not self._skip:
                    out.append(self._head)
                continue
            need = 4 + self._PEEK - len(self._buf)
            self._buf += view[:need]
            view = view[need:]
            if len(self._buf) < 4:
                break
            n = int.from_bytes(self._buf[:4], "big")
            if len(self._buf) < 4 + min(n, self._PEEK):
                continue
            m = self._HEAD.match(self._buf, 4, 4 + min(n, self._PEEK))
            if m is not None:
                head: tuple[str, Optional[int]] = (m.group(1).decode(), int(m.group(2)))
            elif n <= self._PEEK:
                msg = json.loads(bytes(self._buf[4:4 + n]))
                head = (str(msg.get("op")), msg.get("epoch"))
            else:
                head = ("?", None)
            rest = bytes(self._buf[4 + min(n, self._PEEK):])  # bytes of the next frame(s), if any
            self._skip = max(0, n - self._PEEK)
            self._buf = bytearray()
            if self._skip:
                self._head = head
            else:
                out.append(head)
            if rest:
                view = memoryview(rest + bytes(view))
        return out


class _Interned:
    """One copy per process of each big record the agents read (a process hosts hundreds of
    agents; each reads the same 2-MB first configuration over its own connection, as a real
    node does, but 512 copies of it in one process are the simulation's cost, not a node's)."""

    _LOCK = threading.Lock()
    _SEEN: dict[tuple[int, int], bytes] = {}

    @classmethod
    def one(cls, raw: Optional[bytes]) -> Optional[bytes]:
        if raw is None or len(raw) < 65536:
            return raw
        key = (len(raw), hash(raw))
        with cls._LOCK:
            got = cls._SEEN.get(key)
            if got is not None and got == raw:
                return got
            if len(cls._SEEN) > 16:
                cls._SEEN.clear()
            cls._SEEN[key] = raw
            return raw


def _interning(base: type) -> type:
    """``base`` (a membership store class) whose reads return :class:`_Interned` copies."""

    class Interning(base):  # type: ignore[misc, valid-type]
        def clone(self) -> Any:
            twin = super().clone()
            twin.__class__ = Interning
            return twin

        def get(self, key: str) -> Optional[bytes]:
            return _Interned.one(super().get(key))

        def get_many(self, keys: list[str]) -> list[Optional[bytes]]:
            return [_Interned.one(r) for r in super().get_many(keys)]

        def wait_for(self, key: str, timeout: float, stop: Any = None) -> Optional[bytes]:
            return _Interned.one(super().wait_for(key, timeout, stop))

        def highest(self, prefix: str) -> Any:
            got = super().highest(prefix)
            return None if got is None else (got[0], _Interned.one(got[1]))

    Interning.__name__ = Interning.__qualname__ = f"Interning{base.__name__}"
    return Interning


class RankSim:
    """``ranks`` simulated ranks per agent, all on one selector thread."""

    def __init__(self, agents: list[Any], ranks: int, beat_every: float, sockets: int) -> None:
        from ftc10d.membership.local import encode

        self._encode = encode
        self.sel = selectors.DefaultSelector()
        self.conns: list[tuple[socket.socket, tuple[str, ...], Any]] = []
        self.got: dict[str, list[tuple[int, float]]] = {}  # rank -> (epoch, arrival) in order
        self.beat_every = beat_every
        self._stop = threading.Event()
        self._lock = threading.Lock()
        for agent in agents:
            ids = [rank_id(agent.id, j) for j in range(ranks)]
            k = max(1, min(sockets, ranks))
            for i in range(k):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(agent.path)
                s.sendall(encode({"op": "hello", "pid": os.getpid()}))
                s.setblocking(False)
                mids = tuple(ids[i::k])  # the ranks this socket beats for and receives for
                buf = _Frames()
                self.conns.append((s, mids, buf))
                for mid in mids:
                    self.got[mid] = []
                self.sel.register(s, selectors.EVENT_READ, (mids, buf))
        self.n = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.n += 1
                for s, mids, _ in self.conns:
                    try:
                        s.send(b"".join(self._encode({"op": "beat", "n": self.n, "id": mid}) for mid in mids))
                    except OSError:
                        pass
                next_beat = now + self.beat_every
            for key, _ in self.sel.select(timeout=max(0.0, min(0.05, next_beat - time.monotonic()))):
                mids, buf = key.data
                try:
                    data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(key.fileobj)
                    continue
                t = time.monotonic()
                for op, epoch in buf.feed(data):
                    if op == "cfg" and isinstance(epoch, int):
                        with self._lock:
                            for mid in mids:
                                self.got[mid].append((epoch, t))

    def holding(self, epoch: int) -> int:
        """Ranks that hold ``epoch`` or a later configuration. An agent pushes only what is newer
        than what it pushed, so a rank's last arrival is its newest (walking every arrival of
        every rank was a tenth of an agents' process at 4,096 ranks a process)."""
        with self._lock:
            return sum(1 for g in self.got.values() if g and g[-1][0] >= epoch)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class _HintListener:
    """The notifier's hints as an unloaded process hears them (this one, on real threads, is
    one more connection of the notifier's broadcast, the newest, so among the last served):
    when the coordinator pushed each epoch, apart from the agents' processes' queues."""

    def __init__(self, store: Any) -> None:
        from ftc10d.membership.notify import NOTIFY_KEY, HintClient

        port = store.get(NOTIFY_KEY)
        self.heard: dict[int, float] = {}
        self._client = HintClient(store.host, int(port)) if port and port.isdigit() else None
        self._stop = threading.Event()
        if self._client is not None:
            threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        assert self._client is not None
        while not self._stop.is_set():
            try:
                got = self._client.wait(0.5)
            except OSError:
                return
            t = time.monotonic()
            for e, _ in got:
                self.heard.setdefault(e, t)

    def close(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()


def _latencies(got: dict[str, list[list[float]]], epoch: Optional[int], t0: float,
               skip: tuple[str, ...] = ()) -> list[float]:
    """Per rank, ms from ``t0`` to its first configuration at ``epoch`` or later (a rank may
    receive a later one directly: the agent pushes what is newest)."""
    if epoch is None:
        return []
    out = []
    for mid, arrivals in got.items():
        if mid.startswith(skip):
            continue
        ts = [t for e, t in arrivals if e >= epoch]
        if ts:
            out.append((min(ts) - t0) * 1e3)
    return sorted(out)


class _Children:
    """The agents' processes: ``python membership_scale.py`` again, one per ``--procs``, each
    running :func:`sim_process` and writing what its ranks received to a file.

    ``--host green`` hosts a process's agents on greenlets: gevent's monkey patching (done
    first, above) turns each ``threading.Thread`` of the unchanged agent code into a greenlet
    and each socket wait into a yield to one event loop. 4,096 agents are 16,384 OS threads
    otherwise, and creating and scheduling that many threads, not the agents' work, is what
    2 cores (under gVisor) cannot do. The agents' code is the launcher's, line for line; what
    changes is that a store request (torch's C++ client) holds up the process's other agents
    for its round trip, where threads overlap it: the figures err on the slow side."""

    def __init__(self, procs: int, opts: dict[str, Any]) -> None:
        self.store = host_store()
        self.dir = tempfile.mkdtemp(prefix="ftc10d-scale-")
        with open(os.path.join(self.dir, "opts.json"), "w") as f:
            json.dump(opts, f)
        env = dict(os.environ, FTC10D_SIM_CHILD=opts["host"])
        self.procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), "--procs", str(procs),
                                        "--child-port", str(self.store.port), "--child-dir", self.dir], env=env,
                                       preexec_fn=die_with_parent)
                      for i in range(procs)]

    def collect(self, timeout: float) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        out = {}
        for i, p in enumerate(self.procs):
            code = p.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"agents' process {i} exited with {code}")
            with open(os.path.join(self.dir, f"got-{i}.json")) as f:
                out[i] = json.load(f)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def _child(idx: int, procs: int, port: int, folder: str) -> int:
    with open(os.path.join(folder, "opts.json")) as f:
        opts = json.load(f)
    out = sim_process(idx, procs, port, opts)
    with open(os.path.join(folder, f"got-{idx}.json"), "w") as f:
        json.dump(out, f)
    return 0


class _Hops:
    """Per-hop timestamps in an agents' process, taken by wrapping two agent methods (the agent
    code is not changed): when each hint came off the notifier's socket, and when each agent
    took a configuration (verified, queued to its ranks). And the process's scheduling lag: a
    loop that asks to sleep 10 ms and records how late it wakes (on greenlets, how long other
    agents held the process; with threads, how long the GIL and the CPUs were away)."""

    def __init__(self) -> None:
        self.hinted: dict[int, list[float]] = {}  # epoch -> arrival of its first hint, per agent
        self.taken: dict[int, list[float]] = {}  # epoch -> when each agent took it
        self.lag: list[tuple[float, float]] = []  # (wake time, ms late), 100 a second
        self._stop = threading.Event()

    def install(self) -> None:
        from ftc10d.membership import NodeAgent
        from ftc10d.membership.notify import HintClient

        hops = self
        wait0, take0 = HintClient.wait, NodeAgent._take

        def wait(client: Any, timeout: float) -> Any:
            got = wait0(client, timeout)
            t = time.monotonic()
            seen = client.__dict__.setdefault("_sim_seen", set())
            for e, _ in got:
                if e not in seen:
                    seen.add(e)
                    hops.hinted.setdefault(e, []).append(t)
            return got

        def take(agent: Any, cfg: Any, raw: Optional[bytes]) -> None:
            before = agent._cur
            take0(agent, cfg, raw)
            if agent._cur is cfg and agent._cur is not before:
                hops.taken.setdefault(cfg.epoch, []).append(time.monotonic())

        HintClient.wait = wait  # type: ignore[method-assign]
        NodeAgent._take = take  # type: ignore[method-assign]
        threading.Thread(target=self._watch_lag, daemon=True).start()

    def _watch_lag(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(0.01)
            now = time.monotonic()
            self.lag.append((now, (now - t - 0.01) * 1e3))

    def dump(self) -> dict[str, Any]:
        self._stop.set()
        return {"hinted": self.hinted, "taken": self.taken, "lag": self.lag}


def sim_process(idx: int, nprocs: int, port: int, opts: dict[str, Any]) -> dict[str, Any]:
    from ftc10d.membership import MemberInfo, NodeAgent, Signer
    from ftc10d.membership.agreement import mem_key
    from ftc10d.membership.store import requests_made

    hops = _Hops()
    hops.install()
    if opts.get("monitors") is not None:
        from ftc10d.membership import monitor

        monitor.MONITORS = int(opts["monitors"])

    logging.basicConfig(level=logging.WARNING, format=f"sim{idx} %(asctime)s %(levelname)s %(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if opts["host"] == "threads":
        threading.stack_size(256 << 10)
    control = client_store(port)
    k = opts["nodes"] // nprocs + (1 if idx < opts["nodes"] % nprocs else 0)
    # A store object of its own per agent (clones would share one etcd lease, as a process's threads do).
    agents = [NodeAgent(_store(opts, interned=True), heartbeat_timeout=opts["timeout"],
                        poll_interval=opts["poll"]).start() for _ in range(k)]
    # Each rank's records, as Member.join writes them: on etcd, leased on its node's lease.
    signer = Signer(None)
    for a in agents:
        rs = _store(opts)
        if a._lease is not None:
            rs.borrow_lease(a._lease)
        for j in range(opts["ranks"]):
            mid = rank_id(a.id, j)
            info = MemberInfo(id=mid, handle=rank_handle(a.id, j), host="sim", pid=0)
            rs.put(mem_key(mid), signer.encode(mem_key(mid), info.to_body()), leased=True)
            rs.append_join(mid)
    sim = RankSim(agents, opts["ranks"], opts["timeout"] * opts["rank_beat"], opts["rank_sockets"])
    control.set(f"agents/{idx}", json.dumps([a.id for a in agents]))
    last = window_done = 0
    prof: Any = None
    # The harness's commands: one request per 50 ms (a counter it bumps with each command), not
    # one per command key: on greenlets each is a blocking round trip that holds up every agent
    # of the process.
    cmds: dict[str, str] = {}
    cmd_seen = -1
    answered: Optional[tuple[int, int]] = None
    while True:
        n = control.add("cmd", 0)
        if n != cmd_seen:
            cmd_seen = n
            for key in ("stop", "ask", "silence", "window", "profile", "unprofile"):
                if control.check([key]):
                    cmds[key] = control.get(key).decode()
        if "stop" in cmds:
            break
        if opts.get("profile") and idx == 0:
            # --profile: the first agents' process under cProfile from the exit to its end
            # (on greenlets every agent runs on this one thread, so the profile sees them all).
            if prof is None and "profile" in cmds:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            elif prof is not None and "unprofile" in cmds:
                prof.disable()
                prof.dump_stats(opts["profile"])
                opts["profile"] = None
        # Report, when it changes: how many ranks here hold the epoch the harness asks about.
        if "ask" in cmds:
            epoch = int(cmds["ask"])
            held = (epoch, sim.holding(epoch))
            if held != answered:
                control.set(f"holding/{idx}/{epoch}", str(held[1]))
                answered = held
        if "silence" in cmds and not last:
            victim = cmds["silence"]
            for a in agents:
                if a.id == victim:
                    a._stop.set()  # the node goes silent: every thread of its agent stops, no lease revoked
                    # From its last heartbeat (the store's last sight of it), not from the stop: a
                    # beat interval may separate them, and the target counts from the last beat.
                    control.set("silenced", repr(a._store_ok_at))
            last = 1
        if "window" in cmds and not window_done:
            n0, t0 = requests_made(), time.monotonic()
            time.sleep(float(cmds["window"]))
            control.set(f"window/{idx}", json.dumps([requests_made() - n0, time.monotonic() - t0]))
            window_done = 1
        time.sleep(0.05)
    sim.stop()
    for a in agents:
        a._stop.set()
    return {"got": sim.got, "hops": hops.dump()}


def _store(opts: dict[str, Any], interned: bool = False) -> Any:
    from ftc10d.membership import EtcdMembershipStore, TCPMembershipStore

    if opts.get("etcd"):
        cls = _interning(EtcdMembershipStore) if interned else EtcdMembershipStore
        return cls(opts["etcd"], prefix=opts["prefix"])
    cls = _interning(TCPMembershipStore) if interned else TCPMembershipStore
    return cls("127.0.0.1", opts["store_port"])


def _wait(control: Any, keys: list[str], timeout: float) -> None:
    control.wait(keys, timedelta(seconds=timeout))


def _command(control: Any, key: str, value: str) -> None:
    """A command to the agents' processes (they look at the counter only, every 50 ms)."""
    control.set(key, value)
    control.add("cmd", 1)


def _holding(control: Any, procs: int, epoch: int, want: int, timeout: float) -> int:
    _command(control, "ask", str(epoch))
    deadline = time.monotonic() + timeout
    total = 0
    while time.monotonic() < deadline:
        total = 0
        for i in range(procs):
            key = f"holding/{i}/{epoch}"
            if control.check([key]):
                total += int(control.get(key))
        if total >= want:
            return total
        time.sleep(0.2)
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ftc10d.membership import Agreement, Signer
    from ftc10d.membership.agreement import cfg_key

    opts: dict[str, Any] = {"nodes": args.nodes, "ranks": args.ranks, "timeout": args.timeout, "poll": args.poll,
                            "rank_beat": args.rank_beat, "rank_sockets": args.rank_sockets, "host": args.host,
                            "profile": os.path.abspath(args.profile) if args.profile else None,
                            "monitors": args.monitors}
    coord = etcd = listener = None
    if args.etcd:
        etcd = Etcd()
        opts["etcd"] = [etcd.endpoint]
        opts["prefix"] = f"/sim{time.monotonic_ns()}/"
        store_pid = etcd.proc.pid
    else:
        opts["store_port"] = _free_port()
        coord = _start_coordinator(opts["store_port"], detect=args.coordinator_detect, timeout=args.timeout)
        store_pid = coord.pid
    job = None
    try:
        job = _Children(args.procs, opts)
        control = job.store
        _wait(control, [f"agents/{i}" for i in range(args.procs)], 600)
        nodes = [n for i in range(args.procs) for n in json.loads(control.get(f"agents/{i}"))]
        # Admission through the real join path: the ranks' records and joins (written by their
        # processes), then the first configuration.
        store = _store(opts)
        signer = Signer(None)
        t_join = time.monotonic()
        handles = {rank_id(node, j): rank_handle(node, j) for node in nodes for j in range(args.ranks)}
        size = len(handles)
        ag = Agreement(store, signer, expected=size)
        out = ag.propose_first(reason="simulation")
        if out.config is None:
            raise RuntimeError(f"no first configuration: {out.blocked}")
        e0 = out.config.epoch
        got = _holding(control, args.procs, e0, size, 600)
        formed_s = time.monotonic() - t_join
        first_bytes = len(store.get(cfg_key(e0)) or b"")
        store_peak_mb = _peak_rss_mb(store_pid)  # formation: every node reads the first record at once
        if got < size:
            raise RuntimeError(f"only {got} of {size} ranks hold the first configuration")
        listener = _HintListener(store) if not args.etcd else None
        # Steady state.
        time.sleep(2.0)
        cpu0, w0 = _cpu_seconds(store_pid), time.monotonic()
        sim_cpu0 = sum(_cpu_seconds(p.pid) for p in job.procs)
        _command(control, "window", str(args.window))
        _wait(control, [f"window/{i}" for i in range(args.procs)], args.window + 120)
        w1 = time.monotonic()
        store_cpu = (_cpu_seconds(store_pid) - cpu0) / (w1 - w0)
        sim_cpu = (sum(_cpu_seconds(p.pid) for p in job.procs) - sim_cpu0) / (w1 - w0)
        reqs = [json.loads(control.get(f"window/{i}")) for i in range(args.procs)]
        rate = sum(n / t for n, t in reqs)
        # A rank's exit, reported as the launcher does: a rank of a node still in the job (under
        # overload a starved agent can have been removed already; that change is listed below).
        now = Agreement(_store(opts), signer).latest()
        assert now is not None
        live = [n for n in nodes if rank_id(n, 0) in now.member_set]
        victim = rank_id(live[len(live) // 2], 3)
        # As the launcher does: its node agent holds the configuration, the chain is read from it.
        reporter = Agreement(_store(opts), signer)
        burst_cpu0 = sum(_cpu_seconds(p.pid) for p in job.procs)
        if args.profile:
            _command(control, "profile", "1")
            time.sleep(0.2)
        t_exit = time.monotonic()
        rep = reporter.report_exit(handles[victim], known=now)
        report_ms = (time.monotonic() - t_exit) * 1e3
        if rep.config is None or victim in rep.config.member_set:
            raise RuntimeError(f"the exit of {victim} was not agreed: {rep}")
        e1 = rep.config.epoch
        _holding(control, args.procs, e1, size, 120)
        # The agents' processes' CPU for that change, beyond their steady state: what each node
        # pays for a configuration (here 4,096 of them one after another on 2 cores).
        burst = time.monotonic() - t_exit
        burst_cpu = sum(_cpu_seconds(p.pid) for p in job.procs) - burst_cpu0 - sim_cpu * burst
        if args.profile:
            _command(control, "unprofile", "1")
        # What each real node pays on its own for that change: verify and apply the record.
        decode_ms = _decode_cost(store, signer, e1)
        # A node's silence.
        silent = live[len(live) // 3]
        _command(control, "silence", silent)
        _wait(control, ["silenced"], 60)
        t_silent = float(control.get("silenced"))
        # The chain decides which epoch removed what (under overload others can come between).
        reader = Agreement(_store(opts), signer)
        deadline = time.monotonic() + args.timeout * 10 + 120
        e2, epoch, spurious, silence_reason = None, e0, [], ""
        while e2 is None and time.monotonic() < deadline:
            nxt = reader.read_config(epoch + 1)
            if nxt is None:
                time.sleep(0.1)
                continue
            epoch += 1
            if epoch == e1:
                continue
            if not any(m.startswith(silent + ".") for m in nxt.members) and epoch > e1:
                e2 = epoch
                silence_reason = nxt.reason[:160]  # who removed it (the coordinator, a monitor, a ring)
            else:
                spurious.append(f"epoch {epoch}: {nxt.reason[:160]}")
        if e2 is not None:
            _holding(control, args.procs, e2, size - 1 - args.ranks, 60)
        time.sleep(1.0)
        _command(control, "stop", "1")
        res = job.collect(timeout=600)
    finally:
        if listener is not None:
            listener.close()
        if job is not None:
            job.close()
        if coord is not None:
            coord.kill()
            coord.wait()
        if etcd is not None:
            etcd.stop()
    got = {mid: arrivals for r in res.values() for mid, arrivals in r["got"].items()}
    exit_lat = _latencies(got, e1, t_exit, skip=(victim,))
    silence_lat = _latencies(got, e2, t_silent, skip=(victim, silent + "."))
    hops = [r["hops"] for r in res.values()]
    heard = listener.heard if listener is not None else {}

    def hop(epoch: Optional[int], t0: float, what: str) -> Optional[list[float]]:
        if epoch is None:
            return None
        ts = sorted((t - t0) * 1e3 for h in hops for t in h[what].get(str(epoch), []))
        return [percentile(ts, 50), percentile(ts, 99), len(ts)] if ts else None

    def lag(t0: float, t1: float) -> list[float]:
        xs = sorted(ms for h in hops for t, ms in h["lag"] if t0 <= t <= t1)
        return [percentile(xs, 50), percentile(xs, 99), xs[-1]] if xs else [float("nan")] * 3

    per_hop = {
        "exit": {"agreed_ms": report_ms,
                 "notifier_ms": (heard[e1] - t_exit) * 1e3 if e1 in heard else None,
                 "agents_hinted": hop(e1, t_exit, "hinted"), "agents_took": hop(e1, t_exit, "taken"),
                 "loop_lag": lag(t_exit, t_exit + max(exit_lat) / 1e3)},
        "silence": None if e2 is None else {
            "notifier_ms": (heard[e2] - t_silent) * 1e3 if e2 in heard else None,
            "agents_hinted": hop(e2, t_silent, "hinted"), "agents_took": hop(e2, t_silent, "taken")},
        "steady_loop_lag": lag(w0, w1), "agents_cpu": sim_cpu,
        "exit_cpu_per_node_ms": burst_cpu / args.nodes * 1e3, "exit_cpu_s": burst_cpu,
    }
    return {
        "nodes": args.nodes, "ranks": size, "store": "etcd" if args.etcd else "tcp", "timeout": args.timeout,
        "host": args.host,
        "poll": args.poll, "formed_s": formed_s, "first_record_bytes": first_bytes,
        "store_peak_rss_mb": store_peak_mb, "requests_per_s": rate, "per_node": rate / args.nodes,
        "store_cpu": store_cpu, "report_ms": report_ms,
        "exit_p50": percentile(exit_lat, 50), "exit_p99": percentile(exit_lat, 99), "exit_max": max(exit_lat),
        "exit_n": len(exit_lat),
        "silence_p50": percentile(silence_lat, 50) if silence_lat else None,
        "silence_p99": percentile(silence_lat, 99) if silence_lat else None,
        "silence_first": silence_lat[0] if silence_lat else None,
        "silence_n": len(silence_lat),
        "other_changes": spurious, "silence_removed_by": silence_reason, "decode_ms": decode_ms, "per_hop": per_hop,
        "detector": ("coordinator + rings (backup)" if args.coordinator_detect and not args.etcd
                     else "rings" if args.monitors == 0 or not args.etcd
                     else f"{2 if args.monitors is None else args.monitors} monitor nodes + rings (backup)"),
    }


def _peak_rss_mb(pid: int) -> Optional[float]:
    """The process's peak resident memory so far (VmHWM), MB; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _decode_cost(store: Any, signer: Any, epoch: int) -> float:
    """Median ms to verify the record of ``epoch``, apply it to its predecessor and derive
    what a node derives from it (its heartbeat units, its member index), as one node does it
    (no shared decode). The node holds its predecessor as an agent holds its current one,
    with those already derived."""
    from dataclasses import replace

    from ftc10d.membership import Agreement
    from ftc10d.membership.agreement import Configuration, cfg_key

    base = Agreement(store, signer).read_config(epoch - 1)
    assert base is not None
    raw = store.get(cfg_key(epoch))
    times = []
    for _ in range(5):
        held = replace(base)  # its own derived values, not the shared object's
        held.units, held.position, held.digest
        t = time.perf_counter()
        body = signer.decode(cfg_key(epoch), raw)
        cfg = Configuration.from_body(body, epoch, held) if body is not None else None
        if cfg is not None:
            cfg.units, cfg.unit_order, cfg.position
        times.append((time.perf_counter() - t) * 1e3)
        if cfg is None:
            raise RuntimeError(f"record {epoch} did not apply to its base")
    return sorted(times)[2]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--procs", type=int, default=4, help="processes hosting the agents")
    ap.add_argument("--timeout", type=float, default=1.0, help="heartbeat timeout (s)")
    ap.add_argument("--poll", type=float, default=0.02, help="the agents' poll of the next configuration (TCPStore)")
    ap.add_argument("--window", type=float, default=5.0, help="seconds of steady state measured")
    ap.add_argument("--rank-sockets", type=int, default=None,
                    help="local sockets per node (default: one per rank). Fewer: each carries the beats of "
                         "several ranks and stands for them on arrival (a real agent sends each record to each "
                         "rank, microseconds apart; 8,192 simulated sockets copying every full record starve "
                         "2 cores)")
    ap.add_argument("--rank-beat", type=float, default=0.25,
                    help="a simulated rank beats its agent every this many timeouts (a real rank: 0.1; local "
                         "traffic only, but here it shares the 2 cores with the store and every agent)")
    ap.add_argument("--host", choices=("green", "threads"), default="green",
                    help="how a process hosts its agents: 'threads' (each agent's 4 threads, as under the "
                         "launcher) or 'green' (the same code on gevent greenlets: one OS thread per process; "
                         "the only way 4,096 agents fit on 2 cores)")
    ap.add_argument("--etcd", action="store_true", help="a single-member etcd instead of the TCPStore")
    ap.add_argument("--monitors", type=int, default=None,
                    help="etcd: nodes that watch every heartbeat (ftc10d.membership.monitor.MONITORS, default 2; "
                         "0: the agents' rings alone, at full pace)")
    ap.add_argument("--no-coordinator-detect", dest="coordinator_detect", action="store_false",
                    help="TCPStore: the coordinator only hosts the store; the agents' rings detect at full pace")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="cProfile the first agents' process from a rank's exit until every rank holds it "
                         "(read with python -m pstats FILE)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return _child(args.child, args.procs, args.child_port, args.child_dir)
    # torch's TCPStore client formats the peer's address with getnameinfo() on every connect,
    # a reverse DNS lookup; on this VM about 1 in 25 of them waits 5 s for a nameserver that
    # never answers (measured: 8 of 200 serial connects). Thousands of agents connecting at
    # start-up then spend minutes in it. glibc's RES_OPTIONS caps the wait at 1 s for every
    # process this script starts (the coordinator and the agents' processes inherit it).
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    if args.host == "green":
        try:
            import gevent  # noqa: F401
        except ImportError:
            ap.error("--host green needs gevent: pip install -e '.[bench]' (or make bench), or pass --host threads")
    if args.rank_sockets is None:
        args.rank_sockets = args.ranks
    r = run(args)
    print(f"{args.nodes} node agents x {args.ranks} ranks ({r['ranks']} ranks), {r['store']} store, heartbeat "
          f"timeout {args.timeout:g} s, detection: {r['detector']}, {args.procs} processes ({args.host}), "
          f"{args.rank_sockets} local socket(s) per node; {machine()}")
    rows = [
        ["first configuration formed (all ranks hold it)", f"{r['formed_s']:.1f} s"],
        ["  its record; the store process's peak memory by then",
         f"{r['first_record_bytes'] / 1e6:.2f} MB; " + (f"{r['store_peak_rss_mb']:.0f} MB"
                                                        if r["store_peak_rss_mb"] is not None else "n/a")],
        ["store requests/s, steady state (per node)", f"{r['requests_per_s']:.0f} ({r['per_node']:.1f})"],
        ["store process CPU, steady state", f"{r['store_cpu'] * 100:.0f}% of a core"],
        ["a rank's exit: report_exit agreed", f"{r['report_ms']:.0f} ms"],
        ["  a node verifies and applies that record (each node, in parallel)", f"{r['decode_ms']:.1f} ms"],
        [f"  -> every rank holds it: p50 / p99 / max ({r['exit_n']} ranks)",
         f"{r['exit_p50']:.0f} / {r['exit_p99']:.0f} / {r['exit_max']:.0f} ms"],
        [f"a node's last beat -> every other rank holds its removal: first / p50 / p99 ({r['silence_n']})",
         "n/a" if r["silence_p50"] is None else
         f"{r['silence_first']:.0f} / {r['silence_p50']:.0f} / {r['silence_p99']:.0f} ms"],
    ]
    print(table(["", "measured"], rows))
    ph = r["per_hop"]

    def pq(x: Optional[list[float]]) -> str:
        return "n/a" if not x else f"{x[0]:.0f} / {x[1]:.0f} ms ({x[2]:.0f})"

    def ms(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.0f} ms"

    hop_rows = [["exit: report_exit agreed", ms(ph["exit"]["agreed_ms"])],
                ["exit: the notifier's hint heard by an unloaded listener", ms(ph["exit"]["notifier_ms"])],
                ["exit: hint read by the agents, p50 / p99", pq(ph["exit"]["agents_hinted"])],
                ["exit: agents took it (verified, queued to ranks), p50 / p99", pq(ph["exit"]["agents_took"])],
                ["exit: agents' processes' loop lag meanwhile, p50 / p99 / max",
                 "{:.0f} / {:.0f} / {:.0f} ms".format(*ph["exit"]["loop_lag"])]]
    if ph["silence"] is not None:
        hop_rows += [["silence (from the last beat): hint heard by the listener", ms(ph["silence"]["notifier_ms"])],
                     ["silence: hint read by the agents, p50 / p99", pq(ph["silence"]["agents_hinted"])],
                     ["silence: agents took it, p50 / p99", pq(ph["silence"]["agents_took"])]]
    hop_rows += [["steady state: agents' processes' loop lag, p50 / p99 / max",
                  "{:.0f} / {:.0f} / {:.0f} ms".format(*ph["steady_loop_lag"])],
                 ["steady state: agents' processes' CPU", f"{ph['agents_cpu'] * 100:.0f}% of a core"],
                 ["exit: agents' processes' CPU beyond steady state (per node)",
                  f"{ph['exit_cpu_s']:.2f} s ({ph['exit_cpu_per_node_ms']:.2f} ms)"]]
    print(table(["per hop (each from the event)", "measured"], hop_rows))
    print(f"the silent node was removed by: {r['silence_removed_by'] or 'n/a'}")
    for line in r["other_changes"]:
        print(f"other configuration change meanwhile (not a measured event): {line}")
    dump_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``NodeAgent``: one member of the membership per node, on behalf of its ranks.

Under ``ftc10d launch`` the launcher hosts one agent. Its workers are still
members of every configuration (each rank is listed with its handle: ranks,
uuids and the step-commit protocol are unchanged), but their ids are
``<node>.<token>``, and a member's heartbeat key is its *node's*
(:func:`ftc10d.membership.agreement.hb_key`): while the agent beats, its ranks
are alive to everyone who looks; when it stops, all of them lapse together.

The agent does for the node what every rank did for itself:

- **beat**: writes ``hb/<node>`` every ``heartbeat_interval`` (renews the etcd lease), then
  streams the same record to the coordinator's notifier, whose detector then sees the beat
  when it is written rather than at its next read (:mod:`ftc10d.membership.notify`).
- **watch**: waits for the next configuration -- pushed with the coordinator's hint
  (:mod:`ftc10d.membership.notify`: one poll and one read per job), else one store poll
  per node, never one per rank -- and pushes each record to its workers over the local
  channel (:mod:`ftc10d.membership.local`); announces a store reconnection so that the
  workers look at its incarnation (a store that lost its state is re-formed).
- **detect**: reads the heartbeats of its ``watchers`` ring successors among
  the configuration's *nodes* and proposes the removal of every rank of a node
  that lapsed (a backup read every ``timeout / 4`` while the coordinator announces
  that it reads every node's heartbeat); and watches its own workers' local
  heartbeats, proposing the removal of a rank that stopped beating (a frozen
  process in a live node: fenced like any removed member when it resumes).
  On etcd (no coordinator) the configuration's first two nodes are *monitors*: each
  watches every heartbeat as it is written and judges lapses every 25 ms
  (:mod:`ftc10d.membership.monitor`); the others read their ring every ``timeout / 4``.

On a TCPStore the threads share the agent's one store connection (nobody blocks in
the store: waits are polls or hints): a node costs the store one connection and ~10
requests a second at a 1-s timeout, whatever its number of ranks.
- **io**: one thread serves the local channel (accept, read, buffered writes),
  so that a frozen worker's full socket never blocks the agent
  (:mod:`ftc10d.membership.agent_channel`).

The agent proposes as an *authority* (like the coordinator's detector): its
proposals obey ``min_members`` and the majority rule; it proposes suspicions
only while its node has ranks in the latest configuration, and judges nobody
while its own heartbeats are not flowing (it was frozen, or the store was
away). A worker's exit is reported by the launcher at once (pidfd), as before.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from ftc10d.membership.agreement import KEY_START, Agreement, Configuration, cfg_key, hb_key, new_member_id
from ftc10d.membership.detector import JUDGE_TICK_S, LapseDetector, pace
from ftc10d.membership import monitor as monitor_mod
from ftc10d.membership.agent_channel import LocalChannel, _Conn
from ftc10d.membership.local import b64, encode
from ftc10d.membership.notify import DETECTOR_KEY, NOTIFY_KEY, SAFETY_POLL_S, HintClient
from ftc10d.membership.records import Signer
from ftc10d.membership.store import MembershipStore
from ftc10d.types import MembershipError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: How long the watch thread waits for the next configuration before looking around.
WAIT_SLICE = 5.0
#: An agent that waited for a job to form, connected to the notifier, waits this long after the
#: job's start record appears for the first configuration to be pushed before it reads it from
#: the store itself: ``FIRST_PUSH_WAIT_S`` once the notifier announced that a big record follows
#: (fanned out, paced: the last agents get it seconds later), else ``PUSH_GRACE_S`` (the notifier
#: looks for the first configuration every 100 ms).
FIRST_PUSH_WAIT_S = 30.0
PUSH_GRACE_S = 0.5


def node_ring(cfg: Configuration, node: str, k: int) -> list[str]:
    """The ``k`` nodes after ``node`` in ``cfg`` (nodes in order of their first rank, wrapping)."""
    i = cfg.unit_order.get(node)
    if i is None or k <= 0:
        return []
    units = cfg.unit_list
    n = len(units)
    return [units[(i + j) % n] for j in range(1, min(k, n - 1) + 1)]


class NodeAgent(LocalChannel):
    """A node's member: heartbeats, watches and detects for the ranks of its node.

    Args:
        store: the job's membership store (the agent clones a connection per thread).
        token: the job token; records are signed and verified with it.
        heartbeat_timeout: a node (or a local rank) silent this long is removed.
        heartbeat_interval: default ``heartbeat_timeout / 5`` (a reader's lapse needs a whole
            timeout without a new beat: four missed beats, not one).
        watch_interval: how often the local ranks' beats are judged and, with no coordinator
            detecting, the ring successors' heartbeats read (default ``heartbeat_timeout / 20``: a
            silent node is removed within the timeout + 50 ms + one proposal). When the coordinator
            announces its detector (it reads every node's heartbeat in one request per
            ``heartbeat_timeout / 40``), the ring is read every ``heartbeat_timeout / 4`` only, as a
            second opinion (its reads were two thirds of a node's store requests), and the local
            ranks' beats are judged every ``heartbeat_timeout / 10``.
        watchers: how many ring successor *nodes* each agent watches.
        socket_dir: where the local channel's socket is created (default: a new temporary folder).
        poll_interval: on a TCPStore, how often the next configuration slot is looked for (default
            20 ms; etcd watches instead). One request per interval per node: the largest share of a
            node's store load, traded against the latency of a new configuration.
        thread_init: run first by each of the agent's threads (``ftc10d chaos --hosts`` puts
            them in their host's network namespace, where the workers they speak for live).
    """

    def __init__(
        self,
        store: MembershipStore,
        *,
        token: Optional[str] = None,
        heartbeat_timeout: float = 1.0,
        heartbeat_interval: Optional[float] = None,
        watch_interval: Optional[float] = None,
        watchers: int = 2,
        socket_dir: Optional[str] = None,
        poll_interval: Optional[float] = None,
        thread_init: Optional[Callable[[], None]] = None,
    ) -> None:
        self.id = new_member_id()  # hex only: a rank's id is "<node>.<token>"
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval or heartbeat_timeout / 5
        self.watch_interval = watch_interval or heartbeat_timeout / 20
        self.watchers = watchers
        self.poll_interval = poll_interval
        self._thread_init = thread_init
        self._signer = Signer(token)
        self._store = store
        self._own_dir = socket_dir is None
        self._dir = socket_dir or tempfile.mkdtemp(prefix="ftc10d-node-")
        self.path = os.path.join(self._dir, f"agent-{self.id}.sock")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._listener: Optional[socket.socket] = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, _Conn] = {}
        self._cur: Optional[Configuration] = None
        self._cur_raw: Optional[bytes] = None
        self._inc: Optional[str] = None
        self._store_ok_at = 0.0
        self._lease: Optional[int] = None
        self._beat_gap_at = time.monotonic()
        self._last_seen: dict[str, float] = {}  # local member id -> when its last local beat came
        self._coordinator_detects = False  # announced in the store (DETECTOR_KEY)
        self._hints: Optional[HintClient] = None  # the watch thread's connection to the notifier
        self._monitor: Optional[monitor_mod.BeatMonitor] = None  # etcd: the job-wide watch, while a monitor
        self.proposals = 0  # removals this agent proposed (tests, benchmarks)
        self.pushed = 0  # configurations taken from the record pushed with a hint (no store read)

    # ================================================================ public

    def start(self) -> "NodeAgent":
        """Bind the local channel and start the threads; the first heartbeat is written
        before this returns (a worker's join is admitted only if its node heartbeats)."""
        self._wake_w.setblocking(False)
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(self.path)
            os.chmod(self.path, 0o600)
            lst.listen(1024)
            lst.setblocking(False)
            self._listener = lst
            if self._thread_init is not None:
                # The node's one store connection is opened where its threads live (thread_init:
                # a network namespace): one opened on the caller's thread would go on beating
                # for the node through a cut of the node's own network (finding 32).
                self._call_in_thread(self._open_store)
            else:
                self._open_store()
        except BaseException:
            self._stop.set()
            self._cleanup()
            raise
        if self._store.kind == "etcd" and monitor_mod.MONITORS > 0:  # 0: rings only (as before monitors)
            self._monitor = monitor_mod.BeatMonitor(self._store.clone(), self._signer, self.heartbeat_timeout,
                                        thread_init=self._thread_init)
        for name, fn in (("beat", self._beat_loop), ("watch", self._watch_loop),
                         ("detect", self._detect_loop), ("io", self._io_loop)):
            t = threading.Thread(target=self._guard, args=(fn,), name=f"ftc10d-node-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("membership: node agent %s on %s, via %s", self.id, self.path, self._store.describe())
        return self

    @property
    def current(self) -> Optional[Configuration]:
        """The newest configuration the agent saw."""
        return self._cur

    def local_members(self) -> list[str]:
        """Member ids of the workers connected now."""
        with self._lock:
            return sorted(c.member for c in self._conns.values() if c.member)

    def close(self) -> None:
        """Stop the threads and remove the socket. The node's heartbeat stops: if its ranks are
        still members, the other nodes remove them after the timeout."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        for t in self._threads:
            t.join(2.0)
        if self._monitor is not None:
            self._monitor.close()
        self._cleanup()
        try:
            self._store.revoke()
        except Exception:
            logger.debug("lease revoke failed", exc_info=True)
        if self._thread_init is not None:
            self._store.close()  # the agent's own connection (see _open_store)

    def _open_store(self) -> None:
        if self._thread_init is not None:
            self._store = self._store.clone()
        # On etcd, the ranks' leased records ride on the node's lease: they vanish with it. It
        # outlives the heartbeat timeout counted from the last beat (renewed every two beats):
        # a node frozen for 3 s of a 10-s timeout was removed when its heartbeat vanished with
        # the lease (3 s by default).
        self._store.lease_at_least(self.heartbeat_timeout + 3 * self.heartbeat_interval)
        self._lease = self._store.lease()
        self._beat_once(self._store, 1)

    def _call_in_thread(self, fn: Callable[[], None]) -> None:
        """``fn()`` on a thread that ran ``thread_init`` first, as the agent's threads do."""
        out: dict[str, BaseException] = {}

        def body() -> None:
            try:
                assert self._thread_init is not None
                self._thread_init()
                fn()
            except BaseException as exc:  # re-raised on the caller's thread
                out["error"] = exc

        t = threading.Thread(target=body, name="ftc10d-node-init", daemon=True)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]

    def _cleanup(self) -> None:
        for fd in (self._listener, self._wake_r, self._wake_w):
            if fd is not None:
                fd.close()
        with self._lock:
            for c in self._conns.values():
                c.sock.close()
            self._conns.clear()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def __enter__(self) -> "NodeAgent":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ================================================================ threads

    def _guard(self, fn: Any) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            fn()
        except Exception:
            # Half an agent is worse than none (say, links no one reads while the detector removes
            # their silent ranks): stop it all; the node's heartbeat stops and the others remove it.
            logger.exception("membership: %s thread of node agent %s died; the agent stops",
                             threading.current_thread().name, self.id)
            self._stop.set()
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _broadcast(self, msg: dict[str, Any]) -> None:
        frame = encode(msg)
        with self._lock:
            for c in self._conns.values():
                if c.member is not None or msg.get("op") == "inc":
                    c.out += frame
        self._wake()

    def _thread_store(self) -> MembershipStore:
        """The store a thread of the agent uses: on a TCPStore, the agent's one connection
        (torch's client serializes requests; nobody blocks in the store: waits are polls or
        hints), so a node holds one connection to the store, not one per thread; on etcd a
        clone (its watches block), sharing the node's lease."""
        return self._store if self._store.kind == "tcp" else self._store.clone()

    def _release(self, store: MembershipStore) -> None:
        if store is not self._store:
            store.close()

    def _beat_once(self, store: MembershipStore, n: int) -> None:
        key = hb_key(self.id)
        record = self._signer.encode_beat(key, n)
        store.put(key, record, leased=True)
        self._store_ok_at = time.monotonic()
        hints = self._hints
        if hints is not None:  # streamed to the coordinator's detector once it is in the store
            hints.send_beat(self.id, record)

    def _beat_loop(self) -> None:
        store = self._thread_store()
        ag = Agreement(store, self._signer)
        conn = store.connection_epoch
        n = 1
        next_t = time.monotonic()
        prev_ok = time.monotonic()
        last_keepalive = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - prev_ok > self.heartbeat_timeout / 2:
                self._beat_gap_at = now
            try:
                n += 1
                self._beat_once(store, n)
                if now - last_keepalive > self.heartbeat_interval * 2:
                    store.keepalive()
                    last_keepalive = now
                if store.connection_epoch != conn:
                    inc = ag.incarnation(create=False)
                    conn = store.connection_epoch  # only once the incarnation was read
                    logger.warning("membership: node agent %s reconnected to the store (incarnation %s)", self.id, inc)
                    with self._lock:
                        if inc != self._inc:
                            self._inc = inc
                            self._cur = None  # the watch thread reads this incarnation's chain
                    self._broadcast({"op": "inc"})
                prev_ok = time.monotonic()
            except StoreUnavailableError as exc:
                logger.debug("node agent %s: heartbeat failed: %s", self.id, exc)
            except Exception:
                logger.warning("membership: heartbeat of node agent %s failed", self.id, exc_info=True)
            next_t = pace(next_t, self.heartbeat_interval, self._stop)
        self._release(store)

    def _healthy(self, now: float) -> bool:
        return now - self._store_ok_at < self.heartbeat_timeout / 2 and now - self._beat_gap_at > self.heartbeat_timeout

    def _watch_loop(self) -> None:
        store = self._thread_store()
        if self.poll_interval is not None and hasattr(store, "poll_interval"):
            store.poll_interval = self.poll_interval
        ag = Agreement(store, self._signer)
        hints: Optional[HintClient] = None
        hinted = 0  # the highest epoch hinted (several may come in one read)
        carried: dict[int, bytes] = {}  # records pushed with their hints, not yet taken
        # A lost hint costs at most this (a hint cannot be lost on a live TCP connection but for
        # a bug; a closed one is seen at once): a second, or the timeout if longer, so that a
        # job of thousands of nodes with a long timeout does not pay it in requests.
        safety = max(SAFETY_POLL_S, self.heartbeat_timeout)
        next_try = 0.0
        # While no configuration is held: whether this agent waited for the job to form (its
        # start record was absent when it looked: then the first record comes pushed), and
        # when the start record appeared.
        forming: Optional[bool] = None
        start_seen_at: Optional[float] = None
        while not self._stop.is_set():
            try:
                if hints is None and store.kind == "tcp" and time.monotonic() >= next_try:
                    next_try = time.monotonic() + WAIT_SLICE
                    hints = self._hints = self._connect_hints(store)
                cur = self._cur
                if cur is not None:
                    forming, start_seen_at = None, None
                if cur is None:
                    with self._lock:
                        self._inc = ag.incarnation(create=False)
                    # The job's first configuration comes pushed (the notifier fans a big record
                    # out, paced): 4,096 agents reading a 1-MB record from the store at once took
                    # the store process past 8 GB. Verified as if read; else read from the store.
                    latest = None
                    if carried:
                        e = max(carried)
                        pushed = ag.read_config(e, raw=carried.pop(e))
                        carried.clear()
                        if pushed is not None and pushed.incarnation == self._inc:
                            latest = pushed
                            self.pushed += 1
                    if latest is None and hints is not None:
                        if forming is None:
                            forming = not store.exists(KEY_START)  # else: joining a formed job, read it
                        if forming and start_seen_at is None and store.exists(KEY_START):
                            start_seen_at = time.monotonic()
                        patience = FIRST_PUSH_WAIT_S if hints.announced else PUSH_GRACE_S
                        if forming and (start_seen_at is None or time.monotonic() - start_seen_at < patience):
                            # The start record is there: its configuration is on its way.
                            hints = self._collect(hints, carried, safety if start_seen_at is None or hints.announced
                                                  else PUSH_GRACE_S)
                            continue
                    latest = latest or ag.latest()
                    if latest is None:
                        # Before the first configuration too, one poll per job, not one per node
                        # every 20 ms (4,096 agents waiting for a job to form: 200,000 requests/s).
                        if hints is not None:
                            hints = self._collect(hints, carried, safety)
                        else:
                            store.wait_for(KEY_START, min(WAIT_SLICE, self.heartbeat_timeout), self._stop)
                        continue
                    raw = ag.raw_of(latest) or store.get(cfg_key(latest.epoch))
                    self._take(latest, raw)
                    continue
                ag.remember(cur)
                carried_raw = False
                if hints is not None:
                    # The coordinator polls for the whole job and pushes each new record (a big
                    # one: its epoch only): no store request per change, and one per
                    # ``safety`` in case a hint was lost.
                    try:
                        if hinted <= cur.epoch:
                            for e, r in hints.wait(safety):
                                hinted = max(hinted, e)
                                if r is not None and e > cur.epoch and len(carried) < 64:
                                    carried[e] = r
                    except OSError as exc:
                        logger.info("membership: node agent %s lost the coordinator's hints (%s); polling",
                                    self.id, exc)
                        hints.close()
                        hints = self._hints = None
                        carried.clear()
                        continue
                    raw = carried.pop(cur.epoch + 1, None)
                    carried_raw = raw is not None
                    for e in [e for e in carried if e <= cur.epoch]:
                        del carried[e]
                    if raw is None:  # hinted without its record, or a quiet ``safety`` went by
                        raw = store.get(cfg_key(cur.epoch + 1))
                        if raw is None:
                            hinted = min(hinted, cur.epoch)  # a hint of another incarnation, or a forged one
                else:
                    raw = store.wait_for(cfg_key(cur.epoch + 1), WAIT_SLICE, self._stop)
                if raw is None or self._stop.is_set():
                    continue
                nxt = ag.read_config(cur.epoch + 1, raw=raw)
                if nxt is None and carried_raw:  # a forged push costs one read
                    raw = store.get(cfg_key(cur.epoch + 1))
                    nxt = None if raw is None else ag.read_config(cur.epoch + 1, raw=raw)
                    if raw is None:
                        continue
                if nxt is None:
                    self._stop.wait(self.heartbeat_interval)  # a bad record: wait for a proposer to replace it
                    continue
                self.pushed += carried_raw
                self._take(nxt, raw)
            except StoreUnavailableError:
                # Jittered: a store that timed out under thousands of agents must not get them
                # back all at once.
                self._stop.wait(self.heartbeat_interval * (0.5 + random.random()))
            except Exception:
                logger.warning("membership: watcher of node agent %s failed", self.id, exc_info=True)
                self._stop.wait(self.heartbeat_interval)
        self._hints = None
        if hints is not None:
            hints.close()
        self._release(store)

    def _collect(self, hints: HintClient, carried: dict[int, bytes], timeout: float) -> Optional[HintClient]:
        """Wait up to ``timeout`` for hints (returns when one comes), keeping the records pushed
        with them in ``carried``; the connection, or None if it is gone."""
        try:
            for e, r in hints.wait(timeout):
                if r is not None and len(carried) < 64:
                    carried[e] = r
            return hints
        except OSError:
            hints.close()
            self._hints = None
            carried.clear()
            return None

    def _connect_hints(self, store: MembershipStore) -> Optional[HintClient]:
        """The coordinator's notifier, if it runs one (its port is in the store)."""
        try:
            self._coordinator_detects = store.get(DETECTOR_KEY) is not None
            raw = store.get(NOTIFY_KEY)
            if raw is None or not raw.isdigit():
                return None
            return HintClient(getattr(store, "host", "127.0.0.1"), int(raw))
        except (MembershipError, StoreUnavailableError) as exc:
            logger.info("membership: node agent %s polls for configurations: %s", self.id, exc)
            return None

    def _take(self, cfg: Configuration, raw: Optional[bytes]) -> None:
        with self._lock:
            if self._inc is not None and cfg.incarnation != self._inc:
                return  # a record of the store's state before it was lost (a late read)
            if self._cur is not None and self._cur.incarnation == cfg.incarnation and cfg.epoch <= self._cur.epoch:
                return
            self._cur = cfg
            self._cur_raw = raw
        if raw is not None:
            self._broadcast({"op": "cfg", "epoch": cfg.epoch, "raw": b64(raw)})

    def _detect_loop(self) -> None:
        store = self._thread_store()
        ag = Agreement(store, self._signer, pending_ttl=5 * self.heartbeat_timeout)
        nodes = LapseDetector(self._signer, self.heartbeat_timeout)
        suspects: dict[str, str] = {}
        suspects_epoch = -1
        last_attempt = 0.0
        last_blocked: Optional[str] = None
        last_ring = 0.0
        view: tuple[Optional[Configuration], tuple[str, ...], list[str]] = (None, (), [])
        monitor = self._monitor
        monitoring = False
        prev = time.monotonic()
        # With the coordinator detecting (or monitors, on etcd), this loop judges only the local
        # ranks' beats (and reads the ring as a backup every timeout / 4): a tick every timeout / 10
        # is enough; a monitor judges every node every JUDGE_TICK_S.
        while not self._stop.wait(JUDGE_TICK_S if monitoring
                                  else self.watch_interval if not (self._coordinator_detects or monitor)
                                  else max(self.watch_interval, self.heartbeat_timeout / 10)):
            now = time.monotonic()
            gap = now - prev > self.heartbeat_timeout / 2
            prev = now
            cur = self._cur
            if cur is None:
                continue
            if cur.epoch != suspects_epoch:
                suspects, suspects_epoch = {}, cur.epoch
            if view[0] is not cur:  # once per configuration: O(ranks) at 32,768 ranks is ms
                view = (cur, cur.units.get(self.id, ()), node_ring(cur, self.id, self.watchers))
                if monitor is not None:
                    monitoring = self.id in monitor_mod.monitors_of(cur)
                    if monitoring:
                        monitor.stream()
                    else:
                        monitor.pause()
            mine, ring = view[1], view[2]
            if not mine:
                continue  # none of our ranks is a member: we have no say on suspicions
            healthy = self._healthy(now) and not gap
            fresh: dict[str, str] = {}
            # Local ranks: their beats come over the local channel.
            with self._lock:
                if not healthy:
                    self._last_seen = {m: now for m in mine}
                else:
                    self._last_seen = {m: self._last_seen.get(m, now) for m in mine}
                    for m, t in self._last_seen.items():
                        if now - t > self.heartbeat_timeout and m not in suspects:
                            fresh[m] = "local-heartbeat"
            try:
                ring_every = self.heartbeat_timeout / 4 if self._coordinator_detects or monitor else 0.0
                if monitoring and monitor is not None:
                    if healthy:
                        for u in monitor.lapsed(store, cur, self.id, time.monotonic()):
                            for m in cur.units.get(u, ()):
                                if m not in suspects:
                                    fresh.setdefault(m, "heartbeat")
                elif ring and now - last_ring >= ring_every:
                    last_ring = now
                    raws = store.get_many([hb_key(u) for u in ring])
                    for u in nodes.observe(ring, raws, time.monotonic(), healthy=healthy):
                        for m in cur.units.get(u, ()):
                            if m not in suspects:
                                fresh.setdefault(m, "heartbeat")
                suspects.update(fresh)
                if not fresh and not (suspects and now - last_attempt >= self.heartbeat_timeout):
                    continue
                last_attempt = now
                self.proposals += 1
                why = ", ".join(f"{m}: {w}" for m, w in sorted(suspects.items()))
                out = ag.propose(dict(suspects), reason=f"node {self.id} saw {why}")
                if out.blocked and out.blocked != last_blocked:  # once, not every attempt
                    logger.warning("membership: node agent %s: %s", self.id, out.blocked)
                last_blocked = out.blocked
                if out.config is not None and out.config.epoch > cur.epoch:
                    raw = store.get(cfg_key(out.config.epoch))
                    self._take(out.config, raw)
            except StoreUnavailableError:
                self._stop.wait(self.heartbeat_interval)
            except Exception:
                logger.warning("membership: detector of node agent %s failed", self.id, exc_info=True)
                self._stop.wait(self.heartbeat_interval)
        self._release(store)

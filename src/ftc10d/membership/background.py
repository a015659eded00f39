"""The three background threads of a :class:`~ftc10d.membership.Member`.

One concern, split from ``member.py``; each thread runs on its own store
connection so that none can delay another:

- **beat** (:meth:`~MemberThreads._beat_loop`): the heartbeat counter every
  ``heartbeat_interval`` (and the etcd lease); under a node agent, a beat over
  the local channel instead (:meth:`~MemberThreads._local_beat_loop`). A gap
  longer than half the timeout makes the member suspect itself.
- **detect** (:meth:`~MemberThreads._detect_loop`): reports from the data path and
  from a supervisor, proposed at once; the ring successors' heartbeats, read every
  ``watch_interval``; its own admission while joining.
- **watch** (:meth:`~MemberThreads._watch_loop`): the next configuration slot,
  adopted as soon as it is written.

A mixin: :class:`~ftc10d.membership.Member` owns the state and starts the threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Optional

from ftc10d.membership.agreement import (
    KEY_START,
    Configuration,
    MemberInfo,
    Outcome,
    cfg_key,
    hb_key,
    mem_key,
)
from ftc10d.membership.detector import LapseDetector, pace
from ftc10d.membership.local import NodeLink
from ftc10d.membership.store import MembershipStore
from ftc10d.types import StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: How long the watch thread waits for the next configuration before looking around
#: (its own state may have changed: a re-form, a close).
WAIT_SLICE = 5.0


def ring_successors(cfg: Configuration, member_id: str, k: int) -> list[str]:
    """The ``k`` members after ``member_id`` in ``cfg``'s order (wrapping): whom it watches."""
    if member_id not in cfg.members or k <= 0:
        return []
    i = cfg.members.index(member_id)
    n = cfg.size
    return [cfg.members[(i + j) % n] for j in range(1, min(k, n - 1) + 1)]


class MemberThreads:
    """The background threads of a :class:`~ftc10d.membership.Member` (module docstring)."""

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception:
            logger.exception("membership: %s thread of %s died", threading.current_thread().name, self.id)

    def _running(self) -> bool:
        return not self._stop.is_set() and self._fenced is None

    def _reachable(self) -> None:
        self._unreachable_since = None

    def _unreachable(self, exc: BaseException) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
            logger.warning("membership: %s cannot reach the store: %s", self.id, exc)

    def _beat_loop(self) -> None:
        if self._link is not None:
            if self._link.broken is None:
                self._local_beat_loop(self._link)
            if self._running():
                # Our liveness is our node's heartbeat, which only the agent writes: without it this
                # member is as good as gone (the node's ranks are removed with it, or this one alone).
                logger.error("membership: %s lost its node agent (%s); it heartbeats no more", self.id,
                             self._link.broken)
            return
        store = self._store.clone()
        ag = self._new_agreement(store)
        conn = store.connection_epoch
        next_t = time.monotonic()
        prev_ok = time.monotonic()
        last_keepalive = 0.0
        key = hb_key(self.id)
        while self._running():
            now = time.monotonic()
            if now - prev_ok > self.heartbeat_timeout / 2:
                self._suspect_self = True  # we were frozen or cut off: verify before the next op
                self._beat_gap_at = now
            try:
                self._beats += 1
                store.put(key, self._signer.encode_beat(key, self._beats), leased=True)
                if now - last_keepalive > self.heartbeat_interval * 2:
                    store.keepalive()
                    last_keepalive = now
                if store.lease_lost:
                    self._publish_record_only(store)
                if store.connection_epoch != conn:
                    conn = store.connection_epoch
                    self._check_incarnation(ag)
                prev_ok = self._last_beat_ok = time.monotonic()
                self._reachable()
            except StoreUnavailableError as exc:
                self._unreachable(exc)
            except Exception:
                logger.warning("membership: heartbeat of %s failed", self.id, exc_info=True)
            next_t = pace(next_t, self.heartbeat_interval, self._stop)
        store.close()

    def _local_beat_loop(self, link: NodeLink) -> None:
        """Beat to the node agent; an answer says it (and its store heartbeat) is alive. A gap
        in our own beats (we were frozen) makes us suspect ourselves, as with the store."""
        next_t = time.monotonic()
        prev_ok = time.monotonic()
        while self._running() and link.broken is None:
            now = time.monotonic()
            if now - prev_ok > self.heartbeat_timeout / 2:
                self._suspect_self = True
                self._beat_gap_at = now
            self._beats += 1
            ok = link.beat(self._beats, self.id, timeout=self.heartbeat_interval)
            if ok:
                prev_ok = self._last_beat_ok = time.monotonic()
                self._reachable()
            elif ok is False:
                self._unreachable(StoreUnavailableError("the node agent cannot reach the store"))
            next_t = pace(next_t, self.heartbeat_interval, self._stop)

    def _publish_record_only(self, store: MembershipStore) -> None:
        """The lease expired under us (etcd) and a new one was granted: put our member
        record back on it. If we were removed meanwhile, verification fences us."""
        self._suspect_self = True
        body = MemberInfo(id=self.id, handle=self.handle).to_body()
        store.put(mem_key(self.id), self._signer.encode(mem_key(self.id), body), leased=True)

    def _healthy(self, now: float) -> bool:
        """Whether our own heartbeats have flowed for a full timeout: only then do we judge
        others' silence (a store outage or our own freeze silences everyone alike)."""
        return (now - self._last_beat_ok < self.heartbeat_timeout / 2
                and now - self._beat_gap_at > self.heartbeat_timeout)

    def _detect_loop(self) -> None:
        store = self._store.clone()
        ag = self._new_agreement(store)
        detector = LapseDetector(self._signer, self.heartbeat_timeout)
        conn = store.connection_epoch
        last_attempt = 0.0
        last_blocked_set: Optional[frozenset[str]] = None
        suspects: dict[str, str] = {}  # our own suspicions about members of `suspects_epoch`
        suspects_epoch = -1
        next_t = time.monotonic()
        while self._running():
            reports: list[tuple[str, str]] = []
            try:
                reports.append(self._reports.get(timeout=max(0.0, next_t - time.monotonic())))
                while True:
                    reports.append(self._reports.get_nowait())
            except queue.Empty:
                pass
            if not self._running():
                break
            now = time.monotonic()
            if now >= next_t:
                # Without a ring to read (a node agent watches for us) only reports wake us: they come
                # through the queue at once; the tick is left for retries of a blocked proposal.
                next_t = max(next_t + (self.watch_interval if self.watchers > 0 else self.heartbeat_interval), now)
            try:
                if store.connection_epoch != conn:
                    conn = store.connection_epoch
                    self._check_incarnation(ag)
                cur = self._current
                if cur is None or self._reform is not None:
                    if now - last_attempt >= self.heartbeat_interval:
                        last_attempt = now
                        force = self._reform is not None and now - self._reform_since > self.rejoin_grace
                        out = ag.propose(reason="formed by " + self.id, reform=self._reform, force_first=force)
                        self._note(out)
                    continue
                if cur.epoch != suspects_epoch:
                    suspects, suspects_epoch = {}, cur.epoch
                fresh: dict[str, str] = {}
                for handle, why in reports:
                    for m, h in zip(cur.members, cur.handles):
                        if h == handle and m != self.id and m not in suspects:
                            fresh[m] = why
                if self.watchers > 0:
                    ids = ring_successors(cur, self.id, self.watchers)
                    if ids:
                        raws = store.get_many([hb_key(m) for m in ids])
                        t = time.monotonic()
                        for m in detector.observe(ids, raws, t, healthy=self._healthy(t)):
                            if m not in suspects:
                                fresh.setdefault(m, "heartbeat")
                self._reachable()
                suspects.update(fresh)
                retry = self._blocked is not None and suspects and now - last_attempt >= self.heartbeat_timeout
                if not fresh and not retry:
                    continue
                key = frozenset(suspects)
                if not fresh and key == last_blocked_set and now - last_attempt < self.heartbeat_interval:
                    continue
                last_attempt = now
                why = ", ".join(f"{m}: {w}" for m, w in sorted(suspects.items()))
                out = ag.propose(dict(suspects), reason=f"{self.id} saw {why}")
                last_blocked_set = key if out.blocked else None
                self._note(out)
            except StoreUnavailableError as exc:
                self._unreachable(exc)
                self._stop.wait(self.heartbeat_interval)
            except Exception:
                logger.warning("membership: detector of %s failed", self.id, exc_info=True)
                self._stop.wait(self.heartbeat_interval)
        store.close()

    def _note(self, out: Outcome) -> None:
        if out.blocked and out.blocked != self._blocked:
            logger.warning("membership: %s: %s", self.id, out.blocked)
        self._blocked = out.blocked
        if out.config is not None:
            self._adopt(out.config)

    def _watch_loop(self) -> None:
        store = self._store.clone()
        ag = self._new_agreement(store)
        conn = store.connection_epoch
        link = self._link
        incs = link.incs if link is not None else 0
        while self._running():
            try:
                if link is not None and link.broken is not None and link.broken != "closed":
                    logger.warning("membership: %s watches the store itself from now on", self.id)
                    link = None
                if store.connection_epoch != conn:
                    conn = store.connection_epoch
                    self._check_incarnation(ag)
                cur = self._current
                if cur is not None and cur.incarnation == self._inc and self._reform is None:
                    ag.remember(cur)  # the base of the next record if that is a delta
                    if link is not None:
                        got, raw = link.wait_config(cur.epoch + 1, incs, WAIT_SLICE, self._stop)
                        if got == "inc":
                            incs = link.incs
                            self._check_incarnation(ag)
                            continue
                        if got == "later":
                            raw = store.get(cfg_key(cur.epoch + 1))
                        elif got != "cfg":
                            continue
                    else:
                        raw = store.wait_for(cfg_key(cur.epoch + 1), WAIT_SLICE, self._stop)
                        self._reachable()
                    if raw is None or not self._running():
                        continue
                    nxt = ag.read_config(cur.epoch + 1, raw=raw)
                    if nxt is None:
                        self._stop.wait(self.heartbeat_interval)  # a bad record: wait for a proposer to replace it
                        continue
                    if not self._adopt(nxt) and link is not None and nxt.incarnation != self._inc:
                        # Pushed from a store that lost its state before the agent's word of it came:
                        # look at the incarnation now rather than take the same record again and again.
                        self._check_incarnation(ag)
                        self._stop.wait(self.heartbeat_interval)
                    continue
                # Joining or re-forming: look for the newest configuration of this incarnation.
                latest = ag.latest()
                self._reachable()
                if latest is not None and self._adopt(latest):
                    continue
                if link is not None:
                    # The agent pushes every new configuration: wake on the next one, then read the chain.
                    top = max(link.top(), latest.epoch if latest is not None else 0)
                    got, _ = link.wait_config(top + 1, incs, min(WAIT_SLICE, self.heartbeat_timeout), self._stop)
                    if got == "inc":
                        incs = link.incs
                        self._check_incarnation(ag)
                    continue
                key = cfg_key(latest.epoch + 1) if latest is not None else KEY_START
                store.wait_for(key, min(WAIT_SLICE, self.heartbeat_timeout), self._stop)
            except StoreUnavailableError as exc:
                self._unreachable(exc)
                self._stop.wait(self.heartbeat_interval)
            except Exception:
                logger.warning("membership: watcher of %s failed", self.id, exc_info=True)
                self._stop.wait(self.heartbeat_interval)
        store.close()

"""Heartbeat-lapse detection, judged on the observer's own clock.

A member writes ``hb/<id>`` = a signed, strictly increasing counter every
``heartbeat_interval``. An observer reads the counters of the members it
watches every ``watch_interval`` and remembers, for each, the *local*
monotonic time at which it last saw the counter increase. A member whose
counter has not increased for ``timeout`` seconds of the observer's time has
lapsed (it is frozen, partitioned, or dead without a supervisor noticing).

Judging on the observer's clock needs no clock synchronisation between hosts;
and because a lapse needs *two reads* spanning ``timeout`` with no increase,
an observer that was itself frozen or starved does not mistake its own pause
for its peers' (its first read after waking sees their counters moved on).

An observer whose own reads stalled (the store was electing a new leader, or
was overloaded) or who was frozen itself sees *everyone* silent for the length
of its own gap: when two of its reads are more than half a timeout apart, it
restarts every member's clock instead of judging them on that gap.

A heartbeat with a bad signature, or a counter that went backwards (a replayed
old record), counts as no beat. A heartbeat that vanished (an expired etcd
lease) is a lapse at once.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from ftc10d.membership.agreement import hb_key
from ftc10d.membership.records import Signer


#: With beats streamed to it (the coordinator's notifier on TCPStore, an etcd watch for a
#: monitor node), a job-wide detector judges lapses this often between its reads of every
#: heartbeat: a silent node is removed within the timeout + this, not the timeout + two reads
#: (500 ms at a 10-s timeout).
JUDGE_TICK_S = 0.025


def beat_counter(signer: Signer, member_id: str, raw: Optional[bytes]) -> Optional[int]:
    return signer.decode_beat(hb_key(member_id), raw)


def pace(last: float, interval: float, stop: threading.Event) -> float:
    """Wait until ``interval`` after the beat due at ``last`` (or ``stop``) and return when the
    next one is due. A thread more than an interval late (it was frozen or starved) starts
    again from now: no burst of catch-up beats, which would look like a live member."""
    due = last + interval
    delay = due - time.monotonic()
    if delay < -interval:
        return time.monotonic()
    if delay > 0:
        stop.wait(delay)
    return due


class LapseDetector:
    """Tracks heartbeat counters of a changing set of members."""

    def __init__(self, signer: Signer, timeout: float) -> None:
        self.signer = signer
        self.timeout = timeout
        self._last: dict[str, tuple[int, float]] = {}  # id -> (highest counter, local time it was first seen)
        self._raw: dict[str, bytes] = {}  # id -> its record as last read (unchanged: no need to verify it again)
        self._prev_now: Optional[float] = None

    def observe(self, ids: list[str], raws: list[Optional[bytes]], now: float, healthy: bool = True) -> list[str]:
        """Record one read of ``ids``' heartbeats at local time ``now``; return those that lapsed.
        Members no longer in ``ids`` are forgotten; new ones get a full ``timeout`` of grace.
        ``healthy=False`` (the observer's own heartbeats are not flowing) judges nobody."""
        lapsed: list[str] = []
        keep: dict[str, tuple[int, float]] = {}
        seen_raw: dict[str, bytes] = {}
        if not healthy or (self._prev_now is not None and now - self._prev_now > self.timeout / 2):
            # Our own observation had a gap: nobody can be judged on it.
            self._last = {m: (n, now) for m, (n, _) in self._last.items()}
        self._prev_now = now
        for mid, raw in zip(ids, raws):
            prev = self._last.get(mid)
            if prev is not None and raw is not None and self._raw.get(mid) == raw:
                # The same bytes as last read: no beat since. A job-wide detector reads every
                # node's heartbeat 40 times a timeout, and most reads find no change: verifying
                # each signature again was most of its CPU at 4,096 nodes.
                seen_raw[mid] = raw
                keep[mid] = prev
                if healthy and now - prev[1] > self.timeout:
                    lapsed.append(mid)
                continue
            n = beat_counter(self.signer, mid, raw)
            if raw is not None and n is not None:
                seen_raw[mid] = raw
            if prev is None:
                keep[mid] = (n if n is not None else -1, now)
                continue
            if n is not None and n > prev[0]:
                keep[mid] = (n, now)
                continue
            keep[mid] = prev
            if healthy and ((raw is None and prev[0] >= 0) or now - prev[1] > self.timeout):
                lapsed.append(mid)
        self._last = keep
        self._raw = seen_raw
        return lapsed

    def saw(self, member_id: str, raw: bytes, when: float) -> None:
        """A heartbeat record of ``member_id`` seen outside a read (streamed to the observer at
        local time ``when``, after it was written to the store): its counter counts as first
        seen then, if that is new or earlier. Members not being watched are ignored."""
        prev = self._last.get(member_id)
        if prev is None:
            return
        n = beat_counter(self.signer, member_id, raw)
        if n is None:
            return
        if n > prev[0] or (n == prev[0] and when < prev[1]):
            self._last[member_id] = (n, when)
            self._raw[member_id] = raw

    def judge(self, now: float) -> list[str]:
        """The members lapsed at ``now`` on what was seen so far, without a read (between
        reads, with beats streamed by :meth:`saw`). Nobody is judged if the observer's last read
        is more than half a timeout old: its own reads stalled, and the next read resets."""
        if self._prev_now is None or now - self._prev_now > self.timeout / 2:
            return []
        return [m for m, (_, t) in self._last.items() if now - t > self.timeout]


class BeatInbox:
    """Heartbeats that arrived on another thread (the coordinator's notifier stream, an etcd
    watch), the newest per unit with its arrival time, until the detecting thread drains
    them into its :class:`LapseDetector` (:meth:`drain_into`, before each read or judgement).

    Why a buffer rather than calling :meth:`LapseDetector.saw` from the stream's thread: the
    detector belongs to the detecting thread alone (no lock on its path); the stream only
    stores. Bounded: unit names come from the network (a unit already held is always updated).
    """

    def __init__(self, limit: int = 1 << 20) -> None:
        self._limit = limit
        self._beats: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def put(self, unit: str, raw: bytes, when: float) -> None:
        with self._lock:
            if len(self._beats) < self._limit or unit in self._beats:
                self._beats[unit] = (raw, when)

    def drain_into(self, detector: LapseDetector) -> None:
        with self._lock:
            beats, self._beats = self._beats, {}
        for unit, (raw, when) in beats.items():
            detector.saw(unit, raw, when)

    def clear(self) -> None:
        with self._lock:
            self._beats.clear()

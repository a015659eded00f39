"""Job-wide heartbeat monitoring on etcd, by the first nodes of each configuration.

On a TCPStore the coordinator watches every node's heartbeat (the beats are streamed to it)
and the node agents read their ring only as a backup. On etcd there is no coordinator: etcd is
the highly-available part, and the agents are all there is. With rings alone, every agent
reads its ring successors' heartbeats every ``timeout / 20``: at 4,096 nodes and a 10-s timeout
that is ~8,000 etcd requests a second for detection alone, each an HTTP round trip.

Instead the first ``MONITORS`` nodes of the configuration (:func:`monitors_of`, the same for
every agent that holds it) each keep one etcd watch on the heartbeat prefix: every beat arrives
as it is written, and lapses are judged every ``JUDGE_TICK_S`` on arrival times, so a silent
node is removed about a tick past its timeout. A monitor also reads every heartbeat in one
range request every ``timeout / 4``: a heartbeat that vanished (its lease expired) is a lapse,
an event lost with a broken stream is made up, and a monitor whose own reads stall (etcd
electing a leader) judges nobody on that gap (:class:`LapseDetector`). The other agents read
their ring every ``timeout / 4`` only, as a backup for both monitors frozen at once; a single
frozen monitor is removed by the other one, and the next configuration names a new pair.

A streamed beat was in etcd when it was sent: it never makes a node more alive than the store
says. Its record is verified like any read (signature, counter increasing).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ftc10d.membership.configuration import Configuration, hb_key
from ftc10d.membership.detector import BeatInbox, LapseDetector
from ftc10d.membership.records import Signer
from ftc10d.membership.store import MembershipStore
from ftc10d.types import StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: How many nodes of a configuration watch every heartbeat on etcd: two, so that one frozen
#: monitor is removed by the other at its timeout, not by the ring's slower backup. Read when a
#: node agent starts; 0 leaves detection to the rings at their full pace (the behaviour before
#: monitors; ``benchmarks/membership_scale.py --etcd --monitors 0`` compares the two).
MONITORS = 2
#: Streamed beats held between two judgements at most (names come from the network).
_MAX_PENDING = 1 << 20


def monitors_of(cfg: Configuration) -> tuple[str, ...]:
    """The nodes that watch every heartbeat while ``cfg`` is current: its first ``MONITORS``
    heartbeat units in rank order (every holder of ``cfg`` names the same ones)."""
    return cfg.unit_list[:MONITORS]


class BeatMonitor:
    """One node agent's job-wide watch of every heartbeat (while its node is a monitor).

    :meth:`stream` / :meth:`pause` follow the role (the agent's detector calls them for each
    configuration); :meth:`lapsed` is called by that detector every tick while streaming.
    The stream runs on a thread of its own, on a store connection of its own (a watch blocks).
    """

    def __init__(self, store: MembershipStore, signer: Signer, timeout: float,
                 thread_init: Optional[Callable[[], None]] = None) -> None:
        if not hasattr(store, "watch_prefix") or not hasattr(store, "read_prefix"):
            raise TypeError(f"a {type(store).__name__} cannot stream heartbeats (etcd only)")
        self._store: Any = store
        self._timeout = timeout
        self._thread_init = thread_init
        self.detector = LapseDetector(signer, timeout)
        self._pending = BeatInbox(_MAX_PENDING)
        self._on = threading.Event()  # streaming wanted
        self._off = threading.Event()  # stop the stream now (role lost, or closing)
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._next_read = 0.0
        self._units: tuple[Optional[Configuration], list[str], frozenset[str]] = (None, [], frozenset())
        self.streamed = 0  # beats received on the stream (tests, benchmarks)

    @property
    def streaming(self) -> bool:
        return self._on.is_set() and not self._closed

    def stream(self) -> None:
        """Be a monitor: start (or keep) the watch of every heartbeat."""
        if self._closed or self._on.is_set():
            return
        self._off.clear()
        self._on.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftc10d-node-monitor", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """No longer a monitor: end the watch; what was learnt is dropped (a later turn starts
        with a full read, which grants every node a timeout's grace)."""
        if not self._on.is_set():
            return
        self._on.clear()
        self._off.set()
        self.detector = LapseDetector(self.detector.signer, self._timeout)
        self._next_read = 0.0
        self._pending.clear()

    def close(self) -> None:
        self._closed = True
        self._off.set()
        self._on.set()  # wakes the thread to see it is closed
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self._store.close()
        except Exception:
            pass

    def lapsed(self, store: MembershipStore, cur: Configuration, me: str, now: float) -> list[str]:
        """The heartbeat units of ``cur`` (other than ``me``) silent for more than the timeout:
        on a full read every ``timeout / 4``, else on the beats streamed since."""
        if self._units[0] is not cur:  # once per configuration (O(ranks))
            units = [u for u in cur.unit_list if u != me]
            self._units = (cur, units, frozenset(units))
        units, known = self._units[1], self._units[2]
        self._pending.drain_into(self.detector)  # first: a streamed beat arrived before this read
        if now >= self._next_read:
            self._next_read = now + self._timeout / 4
            values = self._store_read(store)
            return self.detector.observe(units, [values.get(hb_key(u)) for u in units], time.monotonic())
        return [u for u in self.detector.judge(now) if u in known]

    @staticmethod
    def _store_read(store: MembershipStore) -> dict[str, bytes]:
        read: Any = getattr(store, "read_prefix")
        return read("hb/")

    def _on_put(self, key: str, raw: bytes, when: float) -> None:
        unit = key[len("hb/"):] if key.startswith("hb/") else key
        self._pending.put(unit, raw, when)  # the newest beat, at its own arrival
        self.streamed += 1

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while not self._closed:
            if not self._on.wait(0.5) or self._closed:
                continue
            try:
                self._store.watch_prefix("hb/", self._on_put, self._off)
            except StoreUnavailableError as exc:
                logger.info("membership: heartbeat monitor stream broke (%s); reopening", exc)
                self._off.wait(0.2)
            except Exception:
                logger.warning("membership: heartbeat monitor stream failed", exc_info=True)
                self._off.wait(1.0)

"""``Member``: one per rank. Joins, heartbeats, detects, agrees, fences.

A member is identified by a random id (not by its process): a process that
was removed and wants back in joins as a *new* member (:meth:`Member.rejoin`),
so nothing it did under its old identity can leak into a later configuration.
Its record carries its ProcessGroup's reconfigure handle, which is what a
configuration lists (in rank order) and what :meth:`Member.apply` hands to
``ftc10d.reconfigure``.

Three background threads (:mod:`ftc10d.membership.background`), each on its own
store connection so that none can delay another:

- **beat**: writes the heartbeat counter every ``heartbeat_interval`` (and
  renews the etcd lease). A gap longer than half the timeout (this process was
  frozen, or the store was unreachable) makes the member *suspect itself*: its
  next operation first checks with the store that it is still a member.
- **detect**: failure detection and proposals. Reports from the data path
  (a ``PeerFailureError`` naming a peer, via ``pg.add_error_listener``) and
  from a supervisor are proposed at once; the heartbeats of ``watchers`` ring
  successors are read every ``watch_interval``, and a lapse is proposed.
  While joining it proposes its own admission.
- **watch**: waits for the next configuration slot (``MembershipStore.wait_for``:
  an etcd watch, or a silent TCPStore ``check`` every 20 ms) and adopts it; a
  configuration that excludes this member fences it.

Fencing: once fenced, every method raises :class:`ftc10d.Fenced`, and every
attached ProcessGroup is aborted, so nothing of the old configuration can go on
(its ops raise ``ProcessGroupAborted``; the next membership call raises
``Fenced``). A member that was frozen past the timeout and resumes finds out
on its next operation: the gap made it suspect itself, so that operation asks
the store first. It can only take part again as a new member (``rejoin()``).

How attached ProcessGroups follow the configurations (``sync``, ``apply``, the aborts)
is :mod:`ftc10d.membership.binding`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from ftc10d.membership.agreement import (
    Agreement,
    Configuration,
    MemberInfo,
    Status,
    hb_key,
    local_identity,
    mem_key,
    new_member_id,
)
from ftc10d.membership.background import MemberThreads
from ftc10d.membership.binding import GroupBinding
from ftc10d.membership.local import NodeLink
from ftc10d.membership.records import Signer
from ftc10d.membership.store import MembershipStore
from ftc10d.types import (
    ErrorType,
    Fenced,
    InvalidOptionError,
    MembershipError,
    MembershipTimeoutError,
    StoreUnavailableError,
)

logger = logging.getLogger("ftc10d")
_SUCCESS = ErrorType.SUCCESS

#: ``merge(stored or None, body) -> new body``: how :meth:`Member.merge_fact` combines a fact.
Merge = Callable[[Optional[dict[str, Any]], dict[str, Any]], dict[str, Any]]

class Member(GroupBinding, MemberThreads):
    """A participant in the membership of a job.

    Args:
        store: a :class:`MembershipStore` (``TCPMembershipStore`` or ``EtcdMembershipStore``).
        handle: this rank's ``pg.get_reconfigure_handle()``.
        token: the job token (default ``$FTC10D_TOKEN``); records are HMAC-signed with it.
        heartbeat_timeout: a member silent this long is removed (default 1 s).
        heartbeat_interval: default ``heartbeat_timeout / 10``.
        watch_interval: how often watched heartbeats are read (default ``heartbeat_timeout / 40``).
        watchers: how many ring successors each member watches (0: rely on a coordinator).
        min_members: no configuration smaller than this is formed (taken from the first member
            that forms the first configuration; it is stored in every configuration).
        expected: the first configuration waits for this many members (default ``min_members``).
        require_majority: removals on suspicion need a majority of the current members.
        rejoin_grace: after a store restart, how long to wait for all previous members to
            rejoin before re-forming without the missing ones (default ``2 * heartbeat_timeout``).
        rendezvous_timeout: bound of each ``pg.reconfigure`` rendezvous in :meth:`sync`
            (default ``10 * heartbeat_timeout``).
        node_agent: the socket of this node's :class:`~ftc10d.membership.agent.NodeAgent`
            (``$FTC10D_NODE_AGENT``, set by ``ftc10d launch``): the agent heartbeats, watches
            and detects for the node; this member beats to it and receives configurations
            from it, and makes no store request of its own in steady state (``watchers`` is 0).
    """

    def __init__(
        self,
        store: MembershipStore,
        handle: str,
        *,
        token: Optional[str] = None,
        heartbeat_timeout: float = 1.0,
        heartbeat_interval: Optional[float] = None,
        watch_interval: Optional[float] = None,
        watchers: int = 2,
        min_members: int = 1,
        expected: Optional[int] = None,
        require_majority: bool = True,
        rejoin_grace: Optional[float] = None,
        rendezvous_timeout: Optional[float] = None,
        node_agent: Optional[str] = None,
    ) -> None:
        if not isinstance(handle, str) or not handle:
            raise InvalidOptionError(f"handle must be a non-empty str (pg.get_reconfigure_handle()), got {handle!r}")
        if heartbeat_timeout <= 0:
            raise InvalidOptionError(f"heartbeat_timeout must be positive, got {heartbeat_timeout}")
        if min_members < 1:
            raise InvalidOptionError(f"min_members must be at least 1, got {min_members}")
        self._settings: dict[str, Any] = dict(
            token=token, heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval,
            watch_interval=watch_interval, watchers=watchers, min_members=min_members, expected=expected,
            require_majority=require_majority, rejoin_grace=rejoin_grace, rendezvous_timeout=rendezvous_timeout,
            node_agent=node_agent,
        )
        self._link: Optional[NodeLink] = NodeLink(node_agent) if node_agent else None
        # Under a node agent the id names the node: whoever reads this member's heartbeat reads its node's.
        self.id = new_member_id() if self._link is None else f"{self._link.node}.{new_member_id()}"
        self.handle = handle
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval or heartbeat_timeout / 10
        self.watch_interval = watch_interval or heartbeat_timeout / 40
        self.watchers = watchers if self._link is None else 0
        self.rejoin_grace = rejoin_grace if rejoin_grace is not None else 2 * heartbeat_timeout
        self.rendezvous_timeout = rendezvous_timeout if rendezvous_timeout is not None else 10 * heartbeat_timeout
        self._signer = Signer(token)
        self._store = store
        if self._link is not None and self._link.lease is not None:
            store.borrow_lease(self._link.lease)
        else:
            # Its heartbeat must not vanish (lease renewed every two beats) before it lapses.
            store.lease_at_least(heartbeat_timeout + 3 * self.heartbeat_interval)
        self._agreement = self._new_agreement(store)
        self._api_lock = threading.Lock()
        self._cv = threading.Condition()
        self._inc_lock = threading.Lock()
        self._current: Optional[Configuration] = None
        self._fenced: Optional[Fenced] = None
        self._blocked: Optional[str] = None
        self._unreachable_since: Optional[float] = None
        self._inc: Optional[str] = None
        self._join_seq: Optional[int] = None
        self._reform: Optional[Configuration] = None
        self._reform_since = 0.0
        self._reforming = False
        self._beats = 0
        self._last_beat_ok = time.monotonic()
        self._verified_at = 0.0
        self._suspect_self = False
        self._beat_gap_at = time.monotonic()  # when our own heartbeats last had a gap (or started)
        self._reports: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pgs: list[Any] = []
        #: (group, configuration) while sync()/apply() waits in that configuration's rendezvous.
        self._applying: Optional[tuple[Any, Configuration]] = None
        #: (group, configuration) while the caller's first collectives on that configuration
        #: run (:meth:`recovering`): a newer configuration aborts the group.
        self._recovering: Optional[tuple[Any, Configuration]] = None
        #: member id -> rendezvous of the newest configuration it missed in a row (NO_SHOW_LIMIT)
        self._no_shows: dict[str, int] = {}
        self._closed = False
        #: name -> (body, merge) of every fact this member merged: put back after the store lost its state.
        self._merged: dict[str, tuple[dict[str, Any], Merge]] = {}

    def _new_agreement(self, store: MembershipStore) -> Agreement:
        s = self._settings
        return Agreement(store, self._signer, self_id=self.id, min_members=s["min_members"],
                         expected=s["expected"], require_majority=s["require_majority"],
                         pending_ttl=5 * self.heartbeat_timeout)

    def __repr__(self) -> str:
        return f"Member({self.id}, {self.status()})"

    # ================================================================= joining

    def join(self) -> "Member":
        """Publish this member and start its threads; returns at once. Admission
        happens at the next epoch: :meth:`wait_next` (or :meth:`sync`) waits for it."""
        if self._threads:
            return self
        with self._api_lock:
            self._inc = self._agreement.incarnation()
            self._publish(self._agreement, last=None)
        for name, fn in (("beat", self._beat_loop), ("detect", self._detect_loop), ("watch", self._watch_loop)):
            t = threading.Thread(target=self._guard, args=(fn,), name=f"ftc10d-member-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("membership: %s joining via %s", self.id, self._store.describe())
        return self

    def _publish(self, ag: Agreement, last: Optional[Configuration]) -> None:
        """Write our member record and a first heartbeat, then log the join (in that order:
        whoever reads the join log finds both)."""
        host, pid = local_identity()
        info = MemberInfo(
            id=self.id, handle=self.handle, host=host, pid=pid,
            last_epoch=last.epoch if last is not None else 0,
            last_rank=last.members.index(self.id) if last is not None and last.includes(self.id) else -1,
            last_inc=last.incarnation if last is not None else "",
        )
        # Under a node agent (etcd), leased records ride on the node's lease (borrowed in __init__).
        ag.store.put(mem_key(self.id), self._signer.encode(mem_key(self.id), info.to_body()), leased=True)
        if self._link is None:
            self._beats += 1
            ag.store.put(hb_key(self.id), self._signer.encode_beat(hb_key(self.id), self._beats), leased=True)
        ag.store.append_join(self.id)
        self._join_seq = None

    def rejoin(self) -> "Member":
        """A new member for the same handle (after being fenced): joins at once. It keeps
        the facts this one merged (see :meth:`merge_fact`)."""
        self.close()
        new = Member(self._store.clone(), self.handle, **self._settings)
        new._merged = dict(self._merged)
        return new.join()

    # ================================================================= queries

    def current(self) -> Optional[Configuration]:
        """The newest configuration this member holds (None until admitted). Raises Fenced."""
        self.check()
        return self._current

    def wait_next(self, after_epoch: int = 0, timeout: Optional[float] = None) -> Configuration:
        """Block until this member holds a configuration with an epoch above ``after_epoch``.

        Raises :class:`ftc10d.Fenced` if it was removed instead, and
        :class:`ftc10d.MembershipTimeoutError` (with the status: below
        ``min_members``, no majority, store unreachable...) after ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        cur: Optional[Configuration] = None
        with self._cv:
            while True:
                if self._fenced is not None:
                    raise self._fenced
                if self._closed:
                    raise MembershipError(f"member {self.id} is closed")
                cur = self._current
                if cur is not None and cur.epoch > after_epoch:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    cur = None
                    break
                self._cv.wait(0.5 if left is None else min(left, 0.5))
        if cur is None:
            # the status outside the condition: it takes the API lock, which _verify holds while it
            # adopts (taking the condition): holding both the other way round could deadlock
            status = self.status(refresh=True)
            raise MembershipTimeoutError(
                f"member {self.id}: no configuration after epoch {after_epoch} within {timeout:g} s; "
                f"status: {status}", status=status)
        self.check()
        return cur

    def connection(self) -> MembershipStore:
        """A connection of the caller's own to this member's store, for a background thread's
        :meth:`merge_fact` (``store=``): it then never waits behind, nor delays, the calls made
        on the member's own connection (a store outage blocks a call up to its reconnect
        timeout). Close it when done."""
        return self._store.clone()

    def merge_fact(self, name: str, body: dict[str, Any], merge: Merge, *,
                   store: Optional[MembershipStore] = None) -> dict[str, Any]:
        """Atomically replace the fact ``name`` by ``merge(stored, body)`` (``stored``: the
        fact now, None if absent or not verifiable) and return what the store holds after.

        A compare-and-set loop on the store's atomic primitive, so that concurrent writers
        never lose each other's updates: with a monotone ``merge`` (e.g. a maximum) the fact
        only ever grows. The member remembers ``(body, merge)`` and merges it again after a
        store restart that lost every record (the members re-form the configuration from
        what they remember; the facts come back the same way). ``store``: a connection from
        :meth:`connection` to use instead of the member's own (no lock taken). Raises
        :class:`ftc10d.StoreUnavailableError` when the store cannot be reached."""
        key = f"fact/{name}"
        if store is not None:
            out = _merge_into(store, self._signer, key, body, merge)
        else:
            with self._api_lock:
                out = _merge_into(self._store, self._signer, key, body, merge)
        self._merged[name] = (body, merge)
        return out

    def fact(self, name: str) -> Optional[dict[str, Any]]:
        """A fact recorded by :meth:`merge_fact` (any member's), or None."""
        key = f"fact/{name}"
        with self._api_lock:
            return self._signer.decode(key, self._store.get(key))

    def status(self, refresh: bool = False) -> Status:
        """Where this member stands (see :class:`Status`); ``refresh`` reads the store's
        pending record so that a member that is not itself proposing sees a block too."""
        cur = self._current
        epoch, size = (cur.epoch, cur.size) if cur is not None else (None, 0)
        if self._closed:
            return Status("closed", epoch, size)
        if self._fenced is not None:
            return Status("fenced", epoch, size, str(self._fenced))
        since = self._unreachable_since
        if since is not None and time.monotonic() - since > self.heartbeat_interval:
            return Status("unreachable", epoch, size,
                          f"store {self._store.describe()} unreachable for {time.monotonic() - since:.1f} s")
        blocked = self._blocked
        if refresh and cur is not None and blocked is None:
            try:
                with self._api_lock:
                    _, blocked, _ = self._agreement.pending(cur.epoch)
            except StoreUnavailableError:
                pass
            blocked = blocked or None
        if cur is None or self._reform is not None:
            return Status("joining", epoch, size, blocked or "waiting to be admitted at the next epoch")
        if blocked:
            return Status("blocked", epoch, size, blocked)
        return Status("member", epoch, size)

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    # ================================================================= fencing

    def check(self) -> None:
        """Raise :class:`ftc10d.Fenced` if this member was removed. Cheap unless the
        member has reason to doubt itself (it was frozen or cut off from the store for
        more than half the timeout): then it asks the store first."""
        fenced = self._fenced
        if fenced is not None:
            raise fenced
        cur = self._current
        if cur is None or self._closed:
            return
        if (self._suspect_self
                or time.monotonic() - max(self._last_beat_ok, self._verified_at) > self.heartbeat_timeout / 2):
            self._verify(cur)
            if self._fenced is not None:
                raise self._fenced

    def _verify(self, cur: Configuration) -> None:
        with self._api_lock:
            try:
                latest = self._agreement.latest(hint=cur.epoch)
            except StoreUnavailableError:
                return  # cannot tell; the data path fails on its own if the peers moved on
            if latest is not None:
                self._adopt(latest)
            self._verified_at = time.monotonic()
            self._suspect_self = False

    def _fence(self, cfg: Configuration, why: str) -> None:
        exc = Fenced(
            f"member {self.id} (handle {self.handle}) was removed from the membership: {why} "
            f"(epoch {cfg.epoch}: {cfg.reason}). It can no longer take part under this identity; "
            "call Member.rejoin() to join again as a new member at a later epoch.",
            member_id=self.id, epoch=cfg.epoch,
        )
        with self._cv:
            if self._fenced is not None:
                return
            self._fenced = exc
            self._cv.notify_all()
        self._stop.set()
        logger.warning("membership: %s fenced at epoch %d: %s", self.id, cfg.epoch, why)
        self._abort_stale(None)

    def _adopt(self, cfg: Configuration) -> bool:
        """Take ``cfg`` as the newest configuration if it is newer; fence if it excludes us.
        Returns whether this member holds ``cfg`` (or a newer one) afterwards."""
        with self._cv:
            if self._fenced is not None or cfg.incarnation != self._inc:
                return False
            cur = self._current
            if cur is not None and cur.incarnation == cfg.incarnation and cfg.epoch <= cur.epoch:
                return cfg.epoch <= cur.epoch
            self_adopted = False
            if not cfg.includes(self.id):
                if cur is not None and cur.incarnation == cfg.incarnation:
                    why = "a later configuration excludes it"
                elif self._join_processed(cfg):
                    why = "its join was processed but not admitted (not heartbeating, or its records did not verify)"
                else:
                    return False  # still joining: a configuration that did not consider us yet
            else:
                self._current = cfg
                self._reform = None
                self._blocked = None
                self._verified_at = time.monotonic()
                self._cv.notify_all()
                logger.info("membership: %s holds %s (rank %d)", self.id, cfg, cfg.members.index(self.id))
                self_adopted = True
        if self_adopted:
            self._abort_stale(cfg)
            return True
        self._fence(cfg, why)
        return False

    def _join_processed(self, cfg: Configuration) -> bool:
        if self._join_seq is None:
            try:
                for seq, mid in self._store.clone().read_joins(0):
                    if mid == self.id:
                        self._join_seq = seq
            except StoreUnavailableError:
                return False
        return self._join_seq is not None and cfg.joins_upto >= self._join_seq

    # ============================================================ store state

    def _check_incarnation(self, ag: Agreement) -> None:
        """After a reconnect: if the store lost its state (new incarnation), rejoin it
        under the same id, remembering our configuration so that it can be re-formed."""
        with self._inc_lock:
            inc = ag.incarnation()
            if inc is None or inc == self._inc:
                return
            cur = self._current
            logger.warning("membership: the store %s lost its state (incarnation %s -> %s); %s rejoins%s",
                           ag.store.describe(), self._inc, inc, self.id, f" to re-form {cur}" if cur else "")
            with self._cv:
                self._inc = inc
                self._reform = cur
                self._reform_since = time.monotonic()
            # The attached groups' generations kept their keys in the lost state: they could
            # not even fail cleanly any more. Abort them now; sync() moves them onto the re-formed one.
            self._abort_stale(None)
            self._publish(ag, last=cur)
            for name, (body, merge) in list(self._merged.items()):
                _merge_into(ag.store, self._signer, f"fact/{name}", body, merge)


    # ================================================================= closing

    def close(self, leave: bool = False) -> None:
        """Stop the threads. With ``leave`` (and still a member) propose our own removal
        first, so that the others need not wait for the heartbeat timeout."""
        if self._closed:
            return
        if leave and self._fenced is None and self._current is not None:
            try:
                with self._api_lock:
                    self._agreement.propose({self.id: "left"}, reason=f"{self.id} left")
            except Exception:
                logger.warning("membership: %s could not announce its leave", self.id, exc_info=True)
        self._closed = True
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._pgs.clear()
        for t in self._threads:
            # Every thread stops within one interval (the watch thread's wait for the next configuration
            # looks at _stop every poll; on etcd it may sit out its watch, up to background.WAIT_SLICE: not waited for).
            # Joined, so that none is inside a store call when the interpreter exits: a daemon thread that
            # returns from C++ during finalization aborts the process ("terminate called without an
            # active exception"), e.g. after the coordinator closed under its reconnect attempts.
            if t is not threading.current_thread() and (not t.name.endswith("watch") or self._store.kind == "tcp"):
                t.join(2.0)
        try:
            self._store.revoke()
        except Exception:
            logger.debug("lease revoke failed", exc_info=True)
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> "Member":
        return self.join()

    def __exit__(self, *exc: Any) -> None:
        self.close()



def _merge_into(store: MembershipStore, signer: Signer, key: str, body: dict[str, Any], merge: Merge) -> dict[str, Any]:
    """:meth:`Member.merge_fact` on one store connection."""
    raw = store.get(key)
    while True:
        old = signer.decode(key, raw) if raw is not None else None
        new = merge(old, body)
        if old is not None and new == old:
            return old
        value = signer.encode(key, new)
        # A record that does not verify (forged, or another token's) is replaced like an absent one.
        swapped, raw = store.create(key, value) if raw is None else store.replace(key, raw, value)
        if swapped:
            return new

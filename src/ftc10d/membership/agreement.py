"""Agreement: exactly one configuration per epoch, decided by an atomic create.

(The records and value types are :mod:`ftc10d.membership.configuration`'s.)
A *configuration* is ``(epoch, uuid, ordered members)``; each member is a
``(member id, reconfigure handle)`` pair, and a handle's position is its rank.
Configurations form a chain in the store, one slot per epoch::

    inc                 incarnation of the store's state: {"nonce"}; created once (atomic create)
    start               the first epoch of this incarnation (atomic create)
    cfg/<epoch>         the configuration of that epoch (atomic create: the epoch bump); for
                        more than FULL_LIMIT members, a delta against cfg/<epoch-1>
    full/<epoch>        a full copy beside every FULL_EVERY-th delta (a joiner's base)
    head                hint: an epoch known to exist (readers probe forward from it)
    pending/<epoch>     removals on top of <epoch> that could not be agreed yet, and why
                        (each entry fades unless refreshed by a proposer that still holds it)
    mem/<id>            a member's record: handle, host, pid, last epoch/rank (leased)
    hb/<unit>           the heartbeat counter of a member, or of its node agent for the
                        ranks under one (ids ``<node>.<token>``: :func:`unit_of`) (leased)
    notify              the coordinator's notifier port (TCPStore; ``notify.py``)
    detector            present while the coordinator reads every heartbeat (node agents
                        then read their ring less often)
    joins               the join log (TCPStore: one appended line per join; etcd: join/<id> keys)

Anyone may *propose* the next configuration: a member whose detector saw a
heartbeat lapse, a member whose collective failed naming a peer, a supervisor
that saw a worker exit, a joiner that wants in. A proposal reads the latest
configuration ``e``, computes ``e+1`` (survivors in their order, then admitted
joiners in join order, a fresh random 63-bit uuid) and tries to *create*
``cfg/<e+1>``. Exactly one proposal per epoch succeeds; the losers re-read
and retry on top of the winner only if their change is still needed. Nobody
holds a lock, so nobody can die holding one.

Safety rules checked by every proposer before it writes:

- ``min_members`` (stored in the configuration, so every proposer applies the
  same one): no configuration smaller than it is formed; the removal waits in
  ``pending/<e>`` and the status says why, until enough members join.
- Majority (``require_majority``): removals on *suspicion* (heartbeat lapse,
  peer error) must leave a strict majority of the current members, not
  counting members whose exit is *confirmed* (reported by the supervisor, left
  gracefully, or superseded by a rejoin of the same process), or exactly half
  of them if that half holds the configuration's first member (a tie-breaker:
  two halves cannot both hold it). A minority cut off from the rest can thus
  never vote the majority out, even when it can still reach the store; a job
  split in two halves (two nodes, two FT-HSDP replicas) goes on with the half
  of its longest-standing member. On etcd a minority cut off from the etcd
  quorum cannot write at all.
- Only a member of the latest configuration may propose removals on suspicion:
  a fenced process that wakes up sees its old peers as lapsed, and must not
  act on that.

A uuid is ``secrets.randbits(63)``: never reused in practice, including across
a restart of a store that lost its state (a fresh incarnation), where counters
would start over.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Optional

from ftc10d.membership.configuration import (  # noqa: F401 - re-exported: the chain's vocabulary
    KEY_INC,
    KEY_START,
    KEY_HEAD,
    FULL_LIMIT,
    FULL_EVERY,
    CONFIRMED,
    cfg_key,
    unit_of,
    hb_key,
    snapshot_key,
    mem_key,
    pending_key,
    new_uuid,
    new_member_id,
    Configuration,
    MemberInfo,
    Status,
    Outcome,
)
from ftc10d.membership.records import Signer
from ftc10d.membership.store import MembershipStore
from ftc10d.types import MembershipError

logger = logging.getLogger("ftc10d")

#: Configurations decoded in this process, by (job key, record key, record bytes): a record
#: that verified once (signature, and its digest, which pins the whole member list) is the
#: same configuration for every reader. A process that hosts many node agents (the scale
#: benchmark, tests) decodes each record once; a launcher's agent, once for its threads.
#: Keyed by a digest of the record (not the record: a full one is megabytes at 32,768 ranks).
_DECODED: "OrderedDict[tuple[str, str, bytes], Configuration]" = OrderedDict()
_DECODING: dict[tuple[str, str, bytes], threading.Event] = {}
_DECODED_LOCK = threading.Lock()
DECODED_KEEP = 8


# ================================================================ agreement


class Agreement:
    """Reads the configuration chain and proposes the next link.

    Used by members, by the coordinator's detector and by a supervisor
    (``report_exit``). ``self_id`` is the proposing member's id (None for an
    authority that is not a member: a supervisor or the coordinator).
    """

    def __init__(
        self,
        store: MembershipStore,
        signer: Signer,
        *,
        self_id: Optional[str] = None,
        min_members: int = 1,
        expected: Optional[int] = None,
        require_majority: bool = True,
        pending_ttl: float = 5.0,
    ) -> None:
        self.store = store
        self.pending_ttl = pending_ttl
        self.signer = signer
        self.self_id = self_id
        self.min_members = min_members
        self.expected = expected
        self.require_majority = require_majority
        self._inc: Optional[str] = None
        self._inc_conn = -1  # the store's connection_epoch when _inc was read
        self._cache: dict[tuple[str, int], Configuration] = {}
        self._raws: dict[tuple[str, int], bytes] = {}  # the records of what is in _cache
        self._round: Optional[tuple[Configuration, dict[str, str], list[tuple[int, str]]]] = None

    # ------------------------------------------------------------------ reads

    def _read(self, key: str) -> Optional[dict[str, Any]]:
        return self.signer.decode(key, self.store.get(key))

    def incarnation(self, create: bool = True) -> Optional[str]:
        """The nonce naming this store's state; a store that lost its state gets a new one."""
        raw = self.store.get(KEY_INC)
        if raw is None and create:
            fresh = {"kind": "inc", "nonce": secrets.token_hex(8)}
            _, raw = self.store.create(KEY_INC, self.signer.encode(KEY_INC, fresh))
        body = self.signer.decode(KEY_INC, raw)
        if body is None:
            if raw is not None and create:
                # A forged or foreign incarnation record: replace it with ours (same CAS discipline as configs).
                ours = self.signer.encode(KEY_INC, {"kind": "inc", "nonce": secrets.token_hex(8)})
                _, raw = self.store.replace(KEY_INC, raw, ours)
                body = self.signer.decode(KEY_INC, raw)
            if body is None:
                return None
        nonce = body.get("nonce")
        self._inc = nonce if isinstance(nonce, str) else None
        self._inc_conn = self.store.connection_epoch
        return self._inc

    def start_epoch(self) -> Optional[int]:
        body = self._read(KEY_START)
        if body is None or not isinstance(body.get("epoch"), int) or body.get("inc") != self._inc_or_read():
            return None
        return int(body["epoch"])

    def _inc_or_read(self) -> Optional[str]:
        if self._inc is not None and self._inc_conn == self.store.connection_epoch:
            return self._inc
        return self.incarnation(create=False)

    def read_config(self, epoch: int, raw: Optional[bytes] = None) -> Optional[Configuration]:
        """The verified configuration of ``epoch`` (None if absent or bad). A delta record is
        applied to its predecessor, from the cache or read (walking back to a full record)."""
        key = cfg_key(epoch)
        if raw is None:
            raw = self.store.get(key)
        if raw is None:
            return None
        memo = (self.signer.key_id, key, hashlib.blake2b(raw, digest_size=20).digest())
        while True:
            with _DECODED_LOCK:
                known = _DECODED.get(memo)
                busy = _DECODING.get(memo) if known is None else None
                if known is None and busy is None:
                    _DECODING[memo] = mine = threading.Event()
            if known is not None:
                self.remember(known)
                self._raws[(known.incarnation, epoch)] = raw
                return known
            if busy is None:
                break
            busy.wait(10.0)  # another thread decodes the same record: use its result
        try:
            return self._decode_config(epoch, key, raw, memo)
        finally:
            with _DECODED_LOCK:
                _DECODING.pop(memo, None)
            mine.set()

    def _decode_config(self, epoch: int, key: str, raw: bytes, memo: tuple[str, str, bytes]) -> Optional[Configuration]:
        body = self.signer.decode(key, raw)
        if body is None:
            return None
        prev = None
        if "members" not in body and isinstance(body.get("base"), int) and body["base"] == epoch - 1:
            prev = self._cache.get((str(body.get("inc")), epoch - 1))
            if prev is None and epoch - 1 >= 1:
                prev = self._read_snapshot(epoch - 1, str(body.get("inc"))) or self.read_config(epoch - 1)
        cfg = Configuration.from_body(body, epoch, prev)
        if cfg is None:
            self.signer._reject(key, str(body)[:200].encode(), "not a valid configuration")
            return None
        with _DECODED_LOCK:
            _DECODED[memo] = cfg
            while len(_DECODED) > DECODED_KEEP:
                _DECODED.popitem(last=False)
        self.remember(cfg)
        self._raws[(cfg.incarnation, epoch)] = raw
        return cfg

    def _read_snapshot(self, epoch: int, inc: str) -> Optional[Configuration]:
        """The full copy of ``epoch`` if one was written (a base for the delta after it)."""
        key = snapshot_key(epoch)
        body = self.signer.decode(key, self.store.get(key))
        if body is None or "members" not in body:
            return None
        cfg = Configuration.from_body(body, epoch)
        if cfg is None or cfg.incarnation != inc:
            return None
        self.remember(cfg)
        return cfg

    def raw_of(self, cfg: Configuration) -> Optional[bytes]:
        """The record ``cfg`` was read from, if this agreement read it (saves reading it again)."""
        return self._raws.get((cfg.incarnation, cfg.epoch))

    def remember(self, cfg: Configuration) -> None:
        """Keep ``cfg`` as the base for reading the next delta record."""
        self._cache[(cfg.incarnation, cfg.epoch)] = cfg
        if len(self._cache) > 2 * FULL_EVERY:
            for k in sorted(self._cache, key=lambda k: k[1])[: len(self._cache) - FULL_EVERY]:
                del self._cache[k]
                self._raws.pop(k, None)
        if len(self._raws) > 4 * FULL_EVERY:
            for k in sorted(self._raws, key=lambda k: k[1])[: len(self._raws) - FULL_EVERY]:
                del self._raws[k]

    def latest(self, hint: Optional[int] = None) -> Optional[Configuration]:
        """The newest valid configuration of this incarnation (None before the first one).

        One round trip on a store that lists keys (etcd: the highest ``cfg/`` key);
        otherwise from the ``start`` record and the ``head``/``hint`` epochs, probing
        forward for slots created since."""
        inc = self._inc_or_read()
        if inc is None:
            return None
        top = self.store.highest("cfg/")
        if top is not None:
            cfg = self.read_config(top[0], raw=top[1])
            if cfg is not None and cfg.incarnation == inc:
                return cfg
            # A bad record at the top (forged, or being replaced): walk the chain below.
        base = self.start_epoch()
        if base is None:
            return None
        epoch = base
        head = self._read(KEY_HEAD)
        if head is not None and isinstance(head.get("epoch"), int):
            epoch = max(epoch, head["epoch"])
        if hint is not None:
            epoch = max(epoch, hint)
        # A configuration this reader already holds (``remember``: a caller's, verified) is not
        # read again: a delta's base may be a full record megabytes long.
        cfg = self._cache.get((inc, epoch)) or self.read_config(epoch)
        if cfg is None and epoch != base:
            epoch, cfg = base, self.read_config(base)
        while cfg is not None and self.store.exists(cfg_key(epoch + 1)):
            nxt = self.read_config(epoch + 1)
            if nxt is None:
                break  # a bad record in the slot: the chain stops here until someone replaces it
            epoch, cfg = epoch + 1, nxt
        if cfg is not None and cfg.incarnation != inc:
            return None
        return cfg

    def member_info(self, member_id: str) -> Optional[MemberInfo]:
        body = self._read(mem_key(member_id))
        return None if body is None else MemberInfo.from_body(body, member_id)

    def pending(self, epoch: int) -> tuple[dict[str, str], str, Optional[bytes]]:
        """(live removals awaiting agreement on top of ``epoch``, why they wait, raw record).

        An entry lives ``pending_ttl`` seconds from its last refresh: suspicions are
        kept alive by the detectors that still hold them (a dead member stays silent),
        and fade if they were wrong (a store outage made everyone look silent)."""
        raw = self.store.get(pending_key(epoch))
        remove, blocked = self._parse_pending(epoch, raw)
        return remove, blocked, raw

    def _parse_pending(self, epoch: int, raw: Optional[bytes]) -> tuple[dict[str, str], str]:
        body = self.signer.decode(pending_key(epoch), raw)
        if body is None or not isinstance(body.get("remove"), dict):
            return {}, ""
        now = time.time()
        remove = {}
        for mid, entry in body["remove"].items():
            if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], (int, float))
                    and (entry[0] in CONFIRMED or now - entry[1] < self.pending_ttl)):
                remove[str(mid)] = str(entry[0])
        return remove, str(body.get("blocked", "")) if remove else ""

    def _read_round(
        self, cur: Optional[Configuration], hint: Optional[int] = None
    ) -> tuple[Optional[Configuration], dict[str, str], list[tuple[int, str]]]:
        """What a proposal is computed from: the latest configuration, its pending removals
        and the joins logged since it. One round trip on etcd; a few cheap ones on TCPStore.
        ``hint``: an epoch known to exist (where to start looking for the latest)."""
        inc = self._inc_or_read()
        if cur is None and self.store.lists_keys and inc is not None:
            known = [c.joins_upto for (i, _), c in self._cache.items() if i == inc]
            head = self.store.read_head(max(known, default=0))  # a lower bound of the latest's cursor
            if head is not None and head.top is not None:
                top = self.read_config(head.top[0], raw=head.top[1])
                if top is not None and top.incarnation == inc:
                    pend: dict[str, str] = {}
                    if head.pending is not None and head.pending[0] == top.epoch:
                        pend = self._parse_pending(top.epoch, head.pending[1])[0]
                    self._round = (top, pend, [(q, m) for q, m in head.joins if q > top.joins_upto])
                    return self._round
        if cur is None:
            cur = self.latest(hint=hint)
        if cur is None:
            return None, {}, []
        self._round = (cur, self.pending(cur.epoch)[0], self.store.read_joins(cur.joins_upto))
        return self._round

    def _write_pending(self, epoch: int, removals: dict[str, str], blocked: str) -> None:
        key = pending_key(epoch)
        for _ in range(8):
            raw = self.store.get(key)
            body = self.signer.decode(key, raw) or {}
            entries = body.get("remove") if isinstance(body.get("remove"), dict) else {}
            now = time.time()
            merged: dict[str, list[Any]] = {}
            for mid, entry in entries.items():
                # (a member's own leave is kept: the last member of a configuration cannot leave
                # it below min_members, so its leave waits here for the next one to apply it)
                if (isinstance(entry, list) and len(entry) == 2 and (mid != self.self_id or entry[0] == "left")
                        and isinstance(entry[1], (int, float)) and now - entry[1] < self.pending_ttl):
                    merged[mid] = entry
            for mid, why in removals.items():
                if (mid != self.self_id or why == "left") and not (mid in merged and merged[mid][0] in CONFIRMED):
                    merged[mid] = [why, now]
            value = self.signer.encode(key, {"kind": "pending", "remove": merged, "blocked": blocked, "t": now})
            ok, _ = self.store.create(key, value) if raw is None else self.store.replace(key, raw, value)
            if ok:
                return

    def _install(self, cfg: Configuration,
                 prev: Optional[Configuration] = None) -> tuple[bool, Optional[Configuration]]:
        """Create ``cfg/<epoch>``; a slot holding a bad record is taken over by CAS."""
        key = cfg_key(cfg.epoch)
        delta = (prev is not None and prev.epoch == cfg.epoch - 1 and prev.incarnation == cfg.incarnation
                 and cfg.size > FULL_LIMIT)
        snap = delta and prev is not None and cfg.epoch - prev.full_epoch >= FULL_EVERY
        body = cfg.to_body(prev if delta else None, snapshot=snap)
        if delta:
            # The writer holds what every reader rebuilds from the record (O(change)), its chained
            # digest and full epoch included: a chained digest names the list only as readers
            # apply it (survivors in order, then the added).
            applied = Configuration.from_body(body, cfg.epoch, prev)
            if applied is None or applied.members != cfg.members or applied.handles != cfg.handles:
                raise MembershipError(f"internal error: the delta record of {cfg} does not reproduce its member "
                                      "list; please report it")
            cfg = applied
        else:
            cfg = replace(cfg, full_epoch=cfg.epoch, chain_digest=None)
        value = self.signer.encode(key, body)
        for _ in range(4):
            ok, now = self.store.create(key, value)
            if ok:
                break
            existing = self.read_config(cfg.epoch, raw=now)
            if existing is not None:
                return False, existing
            ok, now = self.store.replace(key, now, value)  # forged or garbled: replace it
            if ok:
                break
        else:
            return False, None
        if snap:
            try:  # a joiner's base; the chain's readers never need it (lost: their walk is longer)
                self.store.put(snapshot_key(cfg.epoch), self.signer.encode(snapshot_key(cfg.epoch), cfg.to_body()))
            except Exception:
                logger.debug("could not write the full copy of %s", cfg, exc_info=True)
        if not self.store.lists_keys:
            try:
                self.store.put(KEY_HEAD, self.signer.encode(KEY_HEAD, {"epoch": cfg.epoch}))
            except Exception:
                logger.debug("could not update the head hint", exc_info=True)
        self.remember(cfg)
        logger.info("membership: agreed %s: %s", cfg, cfg.reason)
        return True, cfg

    def _quorum(self, cur: Configuration, removals: dict[str, str], new_size: int) -> Optional[str]:
        floor = max(cur.min_members, 1)
        if new_size < floor:
            return (f"{new_size} member(s) would remain, below min_members={floor}; "
                    f"waiting for {floor - new_size} more to join (removing {sorted(removals)})")
        suspected = [m for m, why in removals.items() if why not in CONFIRMED]
        if self.require_majority and suspected:
            confirmed = len(removals) - len(suspected)
            survivors = cur.size - len(removals)
            voters = cur.size - confirmed
            # An exact half goes on only if it holds the configuration's first member (the
            # longest-standing one): the other half cannot hold it too, so at most one side of a
            # split moves on (corosync's auto tie-breaker). It lets a job of two nodes, or two
            # replicas, survive losing one whole node on suspicion alone.
            tie_won = survivors * 2 == voters and bool(cur.members) and cur.members[0] not in removals
            if survivors * 2 <= voters and not tie_won:
                return (f"no majority: removing {len(suspected)} suspected member(s) would leave {survivors} of "
                        f"{voters}; this side may be a partitioned minority, so it will not form a configuration "
                        "(a supervisor's report_exit confirms deaths)")
        return None

    def propose(
        self,
        remove: Optional[dict[str, str]] = None,
        *,
        reason: str = "",
        renew_after: Optional[int] = None,
        reform: Optional[Configuration] = None,
        force_first: bool = False,
        cur: Optional[Configuration] = None,
    ) -> Outcome:
        """Try to agree on the configuration after the latest one.

        ``remove``: member id -> reason (``exit``/``left``/``superseded`` are
        confirmed; anything else is a suspicion). Pending joins are admitted.
        ``renew_after``: also propose when nothing changed, unless the latest
        epoch is already past this one (a rendezvous that failed burned its uuid).
        ``reform``/``force_first``: see :meth:`propose_first`. ``cur``: the latest
        configuration, if the caller just read it (saves a round of reads).
        """
        remove = dict(remove or {})
        for attempt in range(32):
            if attempt == 0 and cur is not None and self._round is not None and self._round[0] is cur:
                cur, pend, joins = self._round  # the caller just read this round (report_exit)
            else:
                cur, pend, joins = self._read_round(cur if attempt == 0 else None)
            if cur is None:
                if remove or renew_after is not None:
                    # A change to a configuration this incarnation does not have: the store lost its
                    # state since the caller read its own (a detector's, an agent's). Forming a first
                    # configuration here, from whoever has rejoined so far, restarted the epochs
                    # below the members' and left them out (chaos, finding 30): only the members
                    # form it (propose_first, re-forming theirs), never a removal.
                    return Outcome(None, blocked="no configuration in this store's incarnation yet: the members "
                                                 "form it first (the store lost its state?)")
                return self.propose_first(reason=reason or "initial configuration", reform=reform, force=force_first)
            removals: dict[str, str] = {}
            for src in (pend, remove):
                for mid, why in src.items():
                    # a member may not suspect itself, but it may announce its own leave
                    if mid in cur.members and (mid != self.self_id or why == "left") \
                            and removals.get(mid) not in CONFIRMED:
                        removals[mid] = why
            if self.self_id is not None and not cur.includes(self.self_id):
                # Not a member of the latest configuration: only confirmed facts and joins may be proposed.
                removals = {m: w for m, w in removals.items() if w in CONFIRMED}
            admit, upto = self._admissions(cur, joins)
            joining = {i.handle for i in admit}
            for mid, h in zip(cur.members, cur.handles):
                if h in joining:
                    removals[mid] = "superseded"
            renew = renew_after is not None and cur.epoch <= renew_after
            if not removals and not admit and not renew:
                return Outcome(cur)
            new = [(m, h) for m, h in zip(cur.members, cur.handles) if m not in removals]
            new += [(i.id, i.handle) for i in admit]
            blocked = self._quorum(cur, removals, len(new))
            if blocked:
                if removals:
                    self._write_pending(cur.epoch, removals, blocked)
                return Outcome(cur, blocked=blocked, removed=removals)
            why = reason or "change"
            if removals:
                why += "; removed " + ", ".join(f"{m} ({w})" for m, w in sorted(removals.items()))
            if admit:
                why += "; admitted " + ", ".join(i.id for i in admit)
            cfg = Configuration(
                epoch=cur.epoch + 1, uuid=new_uuid(), handles=tuple(h for _, h in new),
                members=tuple(m for m, _ in new), incarnation=cur.incarnation, joins_upto=upto,
                min_members=cur.min_members, reason=why,
            )
            won, now = self._install(cfg, prev=cur)
            if won:
                return Outcome(now, changed=True, removed=removals)
            renew_after = None if renew_after is None else max(renew_after, cfg.epoch - 1)
            # Lost the race: re-evaluate on top of the winner (our removals may be done already).
        return Outcome(self.latest(), blocked="too much contention proposing the next configuration")

    def _admissions(self, cur: Configuration, joins: list[tuple[int, str]]) -> tuple[list[MemberInfo], int]:
        """Joins logged after ``cur`` was agreed that can be admitted now, and the new cursor."""
        upto = cur.joins_upto
        admit: dict[str, MemberInfo] = {}  # handle -> newest join of that handle
        for seq, mid in joins:
            upto = max(upto, seq)
            if mid in cur.members:
                continue
            info = self.member_info(mid)
            if info is None:
                logger.warning("membership: join of %s rejected: no valid member record", mid)
                continue
            if not self.store.exists(hb_key(mid)):
                logger.info("membership: join of %s not admitted: it is not heartbeating", mid)
                continue
            admit[info.handle] = info
        return list(admit.values()), upto

    def propose_first(self, *, reason: str, reform: Optional[Configuration] = None, force: bool = False) -> Outcome:
        """Form the first configuration of this incarnation from the joined members.

        A fresh job waits for ``expected`` members (else ``min_members``). After
        the store lost its state, ``reform`` is the proposer's last configuration:
        the first new one waits until all of its members rejoined, or until the
        caller says the grace period is over (``force``).
        """
        inc = self.incarnation()
        if inc is None:
            return Outcome(None, blocked="the store's incarnation record is not readable (wrong token?)")
        infos: dict[str, tuple[int, MemberInfo]] = {}
        upto = 0
        for seq, mid in self.store.read_joins(0):
            upto = max(upto, seq)
            info = self.member_info(mid)
            if info is not None and self.store.exists(hb_key(mid)):
                infos[info.handle] = (seq, info)  # a later join of the same process supersedes
        present = [i for _, i in sorted(infos.values(), key=lambda p: p[0])]
        need = max(self.min_members, self.expected or 1)
        if reform is not None:
            back = {i.id for i in present}
            missing = [m for m in reform.members if m not in back]
            if missing and not force:
                return Outcome(None, blocked=f"re-forming after a store restart: waiting for {len(missing)} member(s) "
                                             f"of epoch {reform.epoch} to rejoin")
            need = max(self.min_members, 1)
        if len(present) < need:
            return Outcome(None, blocked=f"forming: {len(present)} of {need} member(s) joined")
        epoch = max([i.last_epoch for i in present if i.last_inc != inc] + [0]) + 1
        start_value = self.signer.encode(KEY_START, {"kind": "start", "epoch": epoch, "inc": inc})
        ok, raw = self.store.create(KEY_START, start_value)
        if not ok and self.signer.decode(KEY_START, raw) is None:
            ok, raw = self.store.replace(KEY_START, raw, start_value)
        base = self.start_epoch()
        if base is None:
            return Outcome(None, blocked="the start record of this incarnation is not readable")
        # Continuing members keep their order; new ones follow in join order.
        present.sort(key=lambda i: (i.last_inc == inc or i.last_rank < 0, i.last_rank, 0))
        cfg = Configuration(
            epoch=base, uuid=new_uuid(), handles=tuple(i.handle for i in present),
            members=tuple(i.id for i in present), incarnation=inc, joins_upto=upto,
            min_members=max(self.min_members, 1), reason=reason,
        )
        won, now = self._install(cfg)
        if won:
            return Outcome(now, changed=True)
        return Outcome(self.latest())

    def report_exit(self, handle: str, *, reason: str = "exit", known: Optional[Configuration] = None) -> Outcome:
        """A supervisor saw the process behind ``handle`` exit: remove it now (confirmed,
        so no majority is needed). Returns the outcome (unchanged if it was not a member).

        ``known``: a recent configuration the caller holds (a launcher: its node agent's). The
        chain is then read from it: at 32,768 ranks a cold read (a 2-MB full copy and the deltas
        after it) took ~100 ms of the exit's path."""
        if known is not None:
            self.remember(known)
        cur, _, _ = self._read_round(None, hint=None if known is None else known.epoch)
        if cur is None:
            return Outcome(None)
        ids = [m for m, h in zip(cur.members, cur.handles) if h == handle]
        if not ids:
            return Outcome(cur)
        return self.propose({m: reason for m in ids}, reason=f"{handle} exited", cur=cur)


def local_identity() -> tuple[str, int]:
    import os

    return socket.gethostname(), os.getpid()

"""Configuration records: the store's keys, and the value types of the chain.

A :class:`Configuration` is ``(epoch, uuid, ordered members)``, each member a
``(member id, reconfigure handle)`` pair whose position is its rank. Its record
is the full member list, checked by the digest of the whole ordered list, or for a
big configuration only what changed since its predecessor (:meth:`Configuration.to_body`),
checked by a digest chained from the predecessor's (:func:`chain_digest`): a reader
applies a change in time proportional to the change, not to the job
(:meth:`Configuration.from_body`). How the chain is agreed is
:mod:`ftc10d.membership.agreement`'s concern.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

KEY_INC = "inc"
KEY_START = "start"
KEY_HEAD = "head"

#: Configurations up to this size are always written in full; bigger ones as deltas
#: against their predecessor...
FULL_LIMIT = 64
#: ...and every this many epochs a full copy beside the delta, under ``full/<epoch>``: it
#: bounds the walk back of a reader that holds no base (a joiner), while the readers that
#: follow the chain never read it (at 32,768 ranks a full record is ~2 MB, read by every node).
FULL_EVERY = 16

#: Removal reasons that are facts, not suspicions: they do not need a majority.
CONFIRMED = frozenset({"exit", "left", "superseded"})


def cfg_key(epoch: int) -> str:
    return f"cfg/{epoch:012d}"  # zero-padded: sorted listings (etcd) are in epoch order


def unit_of(member_id: str) -> str:
    """The heartbeat unit of a member: its node agent for a rank under ``ftc10d launch``
    (ids ``<node>.<token>``, :mod:`ftc10d.membership.agent`), else the member itself."""
    return member_id.partition(".")[0]


def hb_key(member_id: str) -> str:
    """Where the liveness of ``member_id`` is written: its own counter, or its node's."""
    return f"hb/{unit_of(member_id)}"


def snapshot_key(epoch: int) -> str:
    """The full copy of a configuration written as a delta (every ``FULL_EVERY`` epochs)."""
    return f"full/{epoch:012d}"


def mem_key(member_id: str) -> str:
    return f"mem/{member_id}"


def pending_key(epoch: int) -> str:
    return f"pending/{epoch:012d}"


def new_uuid() -> int:
    """A fresh configuration uuid: random, positive, fits torch's int64."""
    return secrets.randbits(63) or 1


def new_member_id() -> str:
    return secrets.token_hex(8)


# ============================================================== value types


@dataclass(frozen=True)
class Configuration:
    """One agreed configuration. ``handles[r]`` is the reconfigure handle of rank ``r``."""

    epoch: int
    uuid: int
    handles: tuple[str, ...]
    members: tuple[str, ...]
    incarnation: str
    joins_upto: int = 0
    min_members: int = 1
    reason: str = ""
    #: Epoch of the last full record in this configuration's chain (deltas in between).
    full_epoch: int = field(default=0, compare=False)
    #: Set for a configuration written or read as a delta: its :attr:`digest` is then
    #: chained from its base's (:func:`chain_digest`), not computed from the whole list.
    chain_digest: Optional[str] = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.handles)

    @property
    def ranks(self) -> dict[str, int]:
        """Handle -> rank in this configuration."""
        return {h: r for r, h in enumerate(self.handles)}

    def rank_of(self, handle: str) -> Optional[int]:
        try:
            return self.handles.index(handle)
        except ValueError:
            return None

    def includes(self, member_id: str) -> bool:
        return member_id in self.member_set

    def handle_of(self, member_id: str) -> Optional[str]:
        i = self.position.get(member_id)
        return None if i is None else self.handles[i]

    @cached_property
    def position(self) -> dict[str, int]:
        """Member id -> its index (its rank)."""
        return dict(zip(self.members, range(len(self.members))))

    @cached_property
    def member_set(self) -> frozenset[str]:
        return frozenset(self.members)

    @cached_property
    def handle_set(self) -> frozenset[str]:
        return frozenset(self.handles)

    @cached_property
    def units(self) -> dict[str, tuple[str, ...]]:
        """Heartbeat unit -> its members, units in order of their first member (computed once
        per configuration: an agent at 32,768 ranks must not rebuild it on every tick)."""
        out: dict[str, list[str]] = {}
        for m in self.members:  # unit_of inlined: 9 ms at 32,768 ranks, not 90
            u = m.partition(".")[0]
            ms = out.get(u)
            if ms is None:
                out[u] = [m]
            else:
                ms.append(m)
        return {u: tuple(ms) for u, ms in out.items()}

    @cached_property
    def unit_order(self) -> dict[str, int]:
        return {u: i for i, u in enumerate(self.units)}

    @cached_property
    def unit_list(self) -> tuple[str, ...]:
        """The units in order (a ring is read from it: one copy per configuration, not per reader)."""
        return tuple(self.units)

    @cached_property
    def list_digest(self) -> str:
        """A digest of the whole ordered member list (what a full record is checked against)."""
        text = "\n".join(map(" ".join, zip(self.members, self.handles)))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def digest(self) -> str:
        """Names the ordered member list. For a full record, the list's own digest; for a
        delta, chained from the base's digest and the change (:func:`chain_digest`): two
        readers that hold the same digest hold the same list, and a delta applied to another
        base does not reproduce it. Chained because the list's digest costs O(ranks) (~15 ms
        at 32,768 ranks, paid by every node for every change), the chain O(change)."""
        return self.chain_digest if self.chain_digest is not None else self.list_digest

    def to_body(self, prev: Optional["Configuration"] = None, snapshot: bool = False) -> dict[str, Any]:
        """The record of this configuration: the full member list, or, for a big one whose
        predecessor is ``prev``, only what changed (``removed``/``added``). At 4,096 members
        the full list is ~250 KB, and every member reads every record: a delta is ~100 B.
        ``snapshot``: a full copy is written beside this delta (``snapshot_key``)."""
        body: dict[str, Any] = {
            "kind": "config", "epoch": self.epoch, "uuid": self.uuid, "inc": self.incarnation,
            "joins": self.joins_upto, "min": self.min_members, "reason": self.reason,
            "size": self.size,
        }
        delta = (prev is not None and prev.epoch == self.epoch - 1 and prev.incarnation == self.incarnation
                 and self.size > FULL_LIMIT)
        if delta:
            assert prev is not None
            if snapshot:
                body["snap"] = True
            keep = set(self.members)
            old = set(prev.members)
            body["base"] = prev.epoch
            body["removed"] = [m for m in prev.members if m not in keep]
            body["added"] = [[m, h] for m, h in zip(self.members, self.handles) if m not in old]
            body["digest"] = chain_digest(prev.digest, body["removed"], body["added"])
        else:
            body["members"] = [[m, h] for m, h in zip(self.members, self.handles)]
            body["digest"] = self.list_digest
            if self.chain_digest is not None:  # a full copy of a delta: its readers chain on from it
                body["chain"] = self.chain_digest
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any], epoch: int,
                  prev: Optional["Configuration"] = None) -> Optional["Configuration"]:
        """Validate a record's shape (a delta needs its base, ``prev``); None if it is not a
        configuration of ``epoch`` or does not reproduce its digest."""
        try:
            ok = (
                body.get("kind") == "config"
                and body["epoch"] == epoch
                and isinstance(body["uuid"], int) and not isinstance(body["uuid"], bool)
                and 0 < body["uuid"] < 2**63
                and isinstance(body["inc"], str)
                and isinstance(body.get("joins", 0), int)
                and isinstance(body.get("min", 1), int)
            )
            if not ok:
                return None
            full_epoch = epoch
            if "members" in body:
                members = body["members"]
                if not (isinstance(members, list) and all(
                        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in members)):
                    return None
                if len({m for m, _ in members}) != len(members) or len({h for _, h in members}) != len(members):
                    return None
                ids = tuple(m for m, _ in members)
                handles = tuple(h for _, h in members)
                chain = body.get("chain")
                if chain is not None and not isinstance(chain, str):
                    return None
            else:
                if prev is None or body.get("base") != prev.epoch or prev.epoch != epoch - 1 \
                        or prev.incarnation != body["inc"]:
                    return None
                # Only what changed is checked (the base was checked when it was read): at
                # 32,768 members a delta is applied in a few ms, not tens.
                removed, added = body["removed"], body["added"]
                if not (isinstance(removed, list) and all(isinstance(m, str) for m in removed)
                        and isinstance(added, list) and all(
                            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str)
                            for p in added)):
                    return None
                pos = prev.position
                gone = {m for m in removed if m in pos}
                gone_handles = {prev.handles[pos[m]] for m in gone}
                new_ids = [m for m, _ in added]
                new_handles = [h for _, h in added]
                if (len(set(new_ids)) != len(new_ids) or len(set(new_handles)) != len(new_handles)
                        or any(m in pos and m not in gone for m in new_ids)
                        or any(h in prev.handle_set and h not in gone_handles for h in new_handles)):
                    return None
                drop = sorted(pos[m] for m in gone)
                ids = _without(prev.members, drop) + tuple(new_ids)
                handles = _without(prev.handles, drop) + tuple(new_handles)
                full_epoch = epoch if body.get("snap") is True else prev.full_epoch
                chain = chain_digest(prev.digest, removed, added)
                if body.get("digest") != chain:
                    return None  # applied to another base than its writer's
        except (KeyError, TypeError):
            return None
        cfg = cls(
            epoch=epoch,
            uuid=body["uuid"],
            handles=handles,
            members=ids,
            incarnation=body["inc"],
            joins_upto=body.get("joins", 0),
            min_members=body.get("min", 1),
            reason=str(body.get("reason", ""))[:500],
            full_epoch=full_epoch,
            chain_digest=chain,
        )
        if "members" in body and "digest" in body and body["digest"] != cfg.list_digest:
            return None
        if prev is not None and "members" not in body:
            units = _units_after(prev, gone, new_ids)
            if units is not None:
                cfg.__dict__["units"] = units  # seeds the cached property: O(units), not O(ranks)
        return cfg

    def __str__(self) -> str:
        return f"epoch {self.epoch} (uuid {self.uuid}, {self.size} member(s))"


def chain_digest(base_digest: str, removed: list[str], added: list[list[str]]) -> str:
    """The digest of the configuration a delta record makes of a base whose digest is
    ``base_digest``: ``removed`` and ``added`` as the record lists them."""
    change = json.dumps([removed, added], separators=(",", ":"))
    return hashlib.sha256(f"{base_digest}\n{change}".encode()).hexdigest()[:32]


def _units_after(prev: Configuration, gone: set[str], added: list[str]) -> Optional[dict[str, tuple[str, ...]]]:
    """``units`` of the configuration a delta makes of ``prev`` (which has its ``units``
    computed), derived from them: the survivors keep their order, new members are appended.
    None where the order of the units could change (a unit that lost its first member but
    kept others: it is now ordered by a later member), or ``prev``'s were not computed."""
    before = prev.__dict__.get("units")
    if before is None:
        return None
    units = dict(before)
    for u in {m.partition(".")[0] for m in gone}:
        ms = units.get(u)
        if ms is None:
            return None
        kept = tuple(m for m in ms if m not in gone)
        if kept and kept[0] != ms[0]:
            return None
        if kept:
            units[u] = kept
        else:
            del units[u]
    for m in added:
        u = m.partition(".")[0]
        ms = units.get(u)
        units[u] = (m,) if ms is None else ms + (m,)
    return units


def _without(items: tuple[str, ...], drop: list[int]) -> tuple[str, ...]:
    """``items`` without the (sorted) indices ``drop``, by slices: a few removals from a
    32,768-tuple copy it in C instead of testing every element in Python."""
    if not drop:
        return items
    parts: list[tuple[str, ...]] = []
    start = 0
    for i in drop:
        parts.append(items[start:i])
        start = i + 1
    parts.append(items[start:])
    return tuple(itertools.chain.from_iterable(parts))


@dataclass(frozen=True)
class MemberInfo:
    """What a member publishes about itself when it joins (``mem/<id>``)."""

    id: str
    handle: str
    host: str = ""
    pid: int = 0
    last_epoch: int = 0  # its configuration before a store restart (re-forming); 0 for a new member
    last_rank: int = -1
    last_inc: str = ""

    def to_body(self) -> dict[str, Any]:
        return {"kind": "member", "id": self.id, "handle": self.handle, "host": self.host, "pid": self.pid,
                "last_epoch": self.last_epoch, "last_rank": self.last_rank, "last_inc": self.last_inc}

    @classmethod
    def from_body(cls, body: dict[str, Any], member_id: str) -> Optional["MemberInfo"]:
        try:
            if body.get("kind") != "member" or body["id"] != member_id or not isinstance(body["handle"], str):
                return None
            return cls(id=member_id, handle=body["handle"], host=str(body.get("host", "")), pid=int(body.get("pid", 0)),
                       last_epoch=int(body.get("last_epoch", 0)), last_rank=int(body.get("last_rank", -1)),
                       last_inc=str(body.get("last_inc", "")))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity), valid JSON
            return None


@dataclass(frozen=True)
class Status:
    """Where membership stands, as one member (or observer) sees it.

    ``state``: ``joining`` (not admitted yet), ``member`` (in the latest
    configuration), ``blocked`` (a change is needed but cannot be agreed:
    ``detail`` says why, e.g. below ``min_members`` or no majority),
    ``unreachable`` (the store cannot be reached), ``fenced``, ``closed``.
    """

    state: str
    epoch: Optional[int] = None
    size: int = 0
    detail: str = ""

    def __str__(self) -> str:
        where = "" if self.epoch is None else f" at epoch {self.epoch} ({self.size} member(s))"
        return f"{self.state}{where}{': ' + self.detail if self.detail else ''}"


@dataclass
class Outcome:
    """Result of a proposal: the latest configuration afterwards, whether this
    call created it, and why nothing could be agreed (``blocked``)."""

    config: Optional[Configuration]
    changed: bool = False
    blocked: Optional[str] = None
    removed: dict[str, str] = field(default_factory=dict)

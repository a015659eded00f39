"""Rendezvous: how the members of a configuration meet and connect a new generation.

Every member of a configuration (a uuid and its ordered handles) claims the uuid, writes
its arrival and waits for the others', then the backend connects (``Communicator.connect``).
The membership can give a rendezvous up half-way (:class:`PendingRendezvous`: a member left
meanwhile), and every wait here, the backend's connect included, returns at once when it
does (``ReconfigureAbandonedError``): a member never waits out a timeout for a configuration
its peers have already left. The first configuration of a group (no uuid) is
:func:`bootstrap`.

Store layout of a rendezvous (keys under the group's store)::

    ftc10d/cfg/<uuid>/sig          sha256 of the ordered handles, claimed with compare_set;
                                   "used:<sig>" once the members have met (reuse detection)
    ftc10d/cfg/<uuid>/rank/<r>     "<handle>|<global rank>" written by rank r on arrival (compare_set),
                                   or "!abandoned|<why>" once a member gave the rendezvous up
    ftc10d/cfg/<uuid>/<adapter>/...  the backend's own keys (``gloo``: also "ep/<r>", rank r's socket
                                   endpoints); "aborted/<r>" why rank r aborted; "failed": the dead peer
    ftc10d/init/count/<r>          how many groups rank r bootstrapped on this store
    ftc10d/init/<n>/...            the same layout for the n-th initial configuration
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from ftc10d.pg.backend import Communicator
from ftc10d.pg.generation import KEY_ROOT, Generation, long_store_call, release, track_retiring, untrack_retiring
from ftc10d.pg.handles import Plan
from ftc10d.types import (
    ConfigurationMismatchError,
    ReconfigureAbandonedError,
    ReconfigureConnectError,
    ReconfigureTimeoutError,
    UuidReusedError,
)

logger = logging.getLogger("ftc10d")


def handles_digest(handles: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(handles).encode()).hexdigest()[:32]


def claim_uuid(store: dist.Store, plan: Plan) -> None:
    """Claim ``plan.uuid`` for this membership, or raise if it was used before.

    Done before the previous configuration is aborted, so a reused uuid costs
    the caller nothing.
    """
    sig = handles_digest(plan.handles)
    current = store.compare_set(f"{KEY_ROOT}/cfg/{plan.uuid}/sig", "", sig).decode()
    if current == sig:
        return
    if current == f"used:{sig}":
        # A rendezvous given up before this member arrived left a tombstone in its slot: say
        # so (the same error its members got), not "reused", which reads as a caller's bug.
        mine = rank_keys(plan)[plan.rank]
        if store.check([mine]):
            slots = [""] * plan.size
            slots[plan.rank] = store.get(mine).decode()
            gave_up = _abandoned(plan, slots)
            if gave_up is not None:
                raise gave_up
        raise UuidReusedError(
            f"uuid {plan.uuid} was already used for a configuration (or an attempt that failed) with these "
            f"{plan.size} members; every reconfigure needs a fresh uuid"
        )
    raise UuidReusedError(
        f"uuid {plan.uuid} is already taken by a configuration with a different member list: either it was "
        "used before, or members were given different handle lists for it. Pass a fresh uuid, and the same "
        "ordered handles to every member"
    )


#: The value that fills a rank slot of a rendezvous that was given up.
ABANDONED = "!abandoned"


def rank_keys(plan: Plan) -> list[str]:
    """The store keys of ``plan``'s rendezvous, one per rank."""
    return [f"{KEY_ROOT}/cfg/{plan.uuid}/rank/{r}" for r in range(plan.size)]


class SideConnection:
    """A second connection to a group's store, opened in the background ahead of need.

    An abort gives a pending rendezvous up by writing on it while the group's own
    connection is held by the waiting thread. Opened ahead because a connect can take
    seconds (one in about 28 stalls 5 s on the chaos machine, a resolver wait inside
    torch's client), and the whole job, waiting for this member in the next
    rendezvous, would wait that out with it (finding 10 of docs/reliability.md)."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._conn: Optional[dist.Store] = None
        self._lock = threading.Lock()
        self._opening = False

    def open_async(self) -> None:
        with self._lock:
            if self._conn is not None or self._opening:
                return
            self._opening = True
        threading.Thread(target=self._open, name="ftc10d-side-store", daemon=True).start()

    def _open(self) -> None:
        try:
            conn = self._store.clone()
        except Exception as exc:  # an abort then opens one when it needs it
            logger.debug("could not open a second store connection ahead of time: %s", exc)
            conn = None
        with self._lock:
            self._conn, self._opening = conn, False

    def ready(self) -> Optional[dist.Store]:
        """The connection if it is open, else None (never blocks)."""
        return self._conn

    def drop(self) -> None:
        """Forget a connection that failed; the next ``open_async`` opens another."""
        with self._lock:
            self._conn = None


class PendingRendezvous:
    """A rendezvous in progress, which another thread can give up.

    Why: a member blocked here waits for members that may never come, e.g. one
    that adopted a newer configuration a few milliseconds earlier and went
    straight to it. When the membership moves on, the group is aborted, and an
    abort gives the pending rendezvous up at once instead of at its timeout.

    Giving up fills every rank slot still empty with a tombstone (``compare_set``,
    so a slot already taken keeps its member): the waiters, here and on every
    other member, wake at once and raise :class:`ReconfigureAbandonedError`, and
    a member arriving later finds its slot taken and gives up too. Either all of
    the members connect (every slot was taken before the tombstones) or none does.
    The tombstones are written from a short-lived thread on the group's
    :class:`SideConnection`, because the waiting thread holds the first one inside
    ``wait``.
    """

    def __init__(self, store: dist.Store, plan: Plan, given_up: Optional[str] = None,
                 side: Optional[SideConnection] = None) -> None:
        self.store = store
        self.plan = plan
        self.keys = rank_keys(plan)
        self.why = given_up or ""
        self.abandoned = threading.Event()
        self.side = side
        if given_up is not None:
            # Given up before it began: the rendezvous writes the tombstones itself, on its
            # own connection, before it waits; no second connection is needed.
            self.abandoned.set()

    def abandon(self, why: str) -> None:
        """Give the rendezvous up (idempotent; returns at once)."""
        if self.abandoned.is_set():
            return
        self.why = why
        self.abandoned.set()
        threading.Thread(target=self._tombstone, args=(why,), name="ftc10d-abandon", daemon=True).start()

    def _tombstone(self, why: str) -> None:
        value = f"{ABANDONED}|{why}"
        side = self.side.ready() if self.side is not None else None
        for attempt in ("side", "new"):
            if attempt == "side" and side is None:
                continue
            try:
                store = side if attempt == "side" else self.store.clone()
                for key in self.keys:
                    store.compare_set(key, "", value)
                return
            except Exception as exc:  # e.g. the side connection broke: try a new one
                logger.info("rendezvous %d: giving up over the %s connection failed: %s", self.plan.uuid, attempt, exc)
                if attempt == "side" and self.side is not None:
                    self.side.drop()
        logger.warning("rendezvous %d: could not give it up early; its waiters give up at their timeout (%g s)",
                       self.plan.uuid, self.plan.timeout.total_seconds())


#: While a rendezvous waits and its group has no second store connection open yet, how
#: often it looks whether its own member gave it up.
ABANDON_POLL_S = 0.25


def _wait_unless_abandoned(store: dist.Store, keys: list[str], plan: Plan,
                           pending: Optional[PendingRendezvous]) -> None:
    """``store.wait(keys, plan.timeout)``, in one piece once the group's side connection is
    open: :meth:`PendingRendezvous.abandon` then writes the tombstones over it in
    milliseconds, and they end this wait. Until then (a group's first moments) it waits
    in short slices, and if its member gives it up meanwhile it writes the tombstones
    itself on this connection (free between two slices) and returns: a new connection
    could take seconds to open. One wait, not slices, where it can: torch's client logs
    two warnings for each wait that times out (issue 14). Slots already taken keep their
    member (``compare_set``), so the members still all connect, or none does."""
    if pending is None:
        store.wait(keys, plan.timeout)
        return
    deadline = time.monotonic() + plan.timeout.total_seconds()
    while True:
        if pending.abandoned.is_set():
            for key in keys:
                store.compare_set(key, "", f"{ABANDONED}|{pending.why}")
            return
        left = deadline - time.monotonic()
        if left <= 0:
            store.wait(keys, timedelta(milliseconds=1))  # the store's own timeout error unless all arrived
            return
        if pending.side is not None and pending.side.ready() is not None:
            store.wait(keys, timedelta(seconds=left))
            return
        try:
            store.wait(keys, timedelta(seconds=min(ABANDON_POLL_S, left)))
            return
        except Exception as exc:
            if "timeout" not in str(exc).lower():
                raise


def _connect(adapter: type[Communicator], store: dist.Store, plan: Plan,
             pending: Optional[PendingRendezvous]) -> Communicator:
    """``adapter.connect``, which the membership can still give up (``pending``).

    Every member arrived, so every member connects: but one may go on to a newer
    configuration half-way (it connected, then aborted; or it froze), and Gloo's
    full-mesh connect then waits for a pair that will never complete, for as long as
    its own timeout, and cannot be interrupted (chaos: a rank stuck 38 s in the connect
    of a configuration its peers had left 8 ms after they reached it; the others then
    removed it as a no-show, the last holder of a shard). So the connect runs on a
    helper thread: given up, this returns at once, and the helper releases whatever
    the connect makes when it ends (its peers, who moved on, never use it either)."""
    if pending is None:
        with long_store_call():
            return adapter.connect(store, plan.rank, plan.size, plan.timeout)
    box: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            with long_store_call():  # until the connect ends, even after its caller gave it up
                box["comm"] = adapter.connect(store, plan.rank, plan.size, plan.timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller (or dropped, if it left)
            box["exc"] = exc
        with lock:
            done.set()
            orphan = box.get("left", False)
        if orphan:
            comm = box.pop("comm", None)
            if comm is not None:
                holder = [comm.retire()]
                del comm
                release(holder)
            else:
                untrack_retiring()

    helper = threading.Thread(target=run, name="ftc10d-connect", daemon=True)
    helper.start()
    while not done.wait(0.05):
        if pending.abandoned.is_set():
            with lock:
                if not done.is_set():
                    box["left"] = True
                    track_retiring(helper)  # the interpreter's exit waits for it, as for a retire
                    adapter.connect_abandoned(helper)
                    raise ReconfigureAbandonedError(
                        f"reconfigure to uuid {plan.uuid}: the rendezvous was given up while its members "
                        f"connected ({pending.why}). Reconfigure with the newest configuration (a fresh uuid)"
                    )
    if "exc" in box:
        raise box["exc"]
    return box["comm"]


def _abandoned(plan: Plan, values: list[str]) -> Optional[ReconfigureAbandonedError]:
    for r, value in enumerate(values):
        if value.startswith(ABANDONED):
            why = value.partition("|")[2]
            return ReconfigureAbandonedError(
                f"reconfigure to uuid {plan.uuid}: the rendezvous was given up before rank {r} of {plan.size} "
                f"arrived ({why}). Nothing was connected; reconfigure with the newest configuration (a fresh uuid)"
            )
    return None


def rendezvous(
    store: dist.Store,
    plan: Plan,
    global_rank: int,
    op_timeout: timedelta,
    fire_abort_hooks: Callable[[], None],
    adapter: type[Communicator],
    pending: Optional[PendingRendezvous] = None,
) -> Generation:
    """Meet every member of ``plan`` and connect a new communicator of ``adapter``.

    ``pending`` (built by the caller before the call) lets another thread give the
    rendezvous up while it waits (:meth:`PendingRendezvous.abandon`).
    """
    prefix = f"{KEY_ROOT}/cfg/{plan.uuid}"
    sig = handles_digest(plan.handles)
    keys = rank_keys(plan)
    try:
        if pending is not None and pending.abandoned.is_set():
            # Given up before it began: our own slot gets a tombstone, so that no member
            # connects even if all of the others arrive.
            mine = f"{ABANDONED}|{pending.why}"
        else:
            mine = f"{plan.handles[plan.rank]}|{global_rank}"
        got = store.compare_set(keys[plan.rank], "", mine).decode()
        if got != mine:
            raise _abandoned(plan, [got]) or ConfigurationMismatchError(
                f"reconfigure to uuid {plan.uuid}: rank {plan.rank} was already taken by {got.partition('|')[0]!r}; "
                "all members must be given the same ordered handles"
            )
        try:
            with long_store_call():
                _wait_unless_abandoned(store, keys, plan, pending)
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise ReconfigureTimeoutError(
                f"reconfigure to uuid {plan.uuid}: rank(s) {missing} of {plan.size} did not arrive within "
                f"{plan.timeout.total_seconds():g} s (handles {[plan.handles[r] for r in missing]}). "
                "Retry with a fresh uuid and the members that are alive.",
                missing_handles=tuple(plan.handles[r] for r in missing),
            ) from exc
        values = [v.decode() for v in store.multi_get(keys)]
        gave_up = _abandoned(plan, values)
        if gave_up is not None:
            raise gave_up
        global_ranks = []
        for r, value in enumerate(values):
            handle, _, grank = value.partition("|")
            if handle != plan.handles[r]:
                raise ConfigurationMismatchError(
                    f"reconfigure to uuid {plan.uuid}: rank {r} was taken by handle {handle!r} but this member "
                    f"expected {plan.handles[r]!r}; all members must be given the same ordered handles"
                )
            global_ranks.append(int(grank))
    finally:
        # From here on the uuid counts as used, whatever happens.
        store.set(f"{prefix}/sig", f"used:{sig}")
    gen_store = dist.PrefixStore(f"{prefix}/{adapter.name}", store)
    try:
        comm = _connect(adapter, gen_store, plan, pending)
    except ReconfigureAbandonedError:
        raise
    except RuntimeError as exc:  # Gloo's connectFullMesh: a member died or froze after it arrived
        raise ReconfigureConnectError(
            f"reconfigure to uuid {plan.uuid}: all {plan.size} members arrived but connecting them failed "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). Reconfigure again with the members "
            "that are alive and a fresh uuid"
        ) from exc
    if op_timeout != plan.timeout:
        comm.set_timeout(op_timeout)
    return Generation(
        plan.uuid, plan.rank, plan.size, plan.handles, tuple(global_ranks), comm, gen_store, fire_abort_hooks
    )


def bootstrap(
    store: dist.Store,
    handle: str,
    rank: int,
    size: int,
    global_rank: int,
    timeout: timedelta,
    fire_abort_hooks: Callable[[], None],
    adapter: type[Communicator],
) -> Generation:
    """The initial configuration of a group built with ``enable_reconfigure=False``:
    ranks come from the constructor, like ``ProcessGroupGloo``."""
    # Like torch's group counter: the n-th group a rank bootstraps on this store
    # meets the n-th group of every other rank, so groups sharing a store do not collide.
    nth = store.add(f"{KEY_ROOT}/init/count/{rank}", 1)
    prefix = f"{KEY_ROOT}/init/{nth}"
    keys = [f"{prefix}/rank/{r}" for r in range(size)]
    store.set(keys[rank], f"{handle}|{global_rank}")
    with long_store_call():
        store.wait(keys, timeout)
    values = [v.decode().partition("|") for v in store.multi_get(keys)]
    handles = tuple(v[0] for v in values)
    global_ranks = tuple(int(v[2]) for v in values)
    gen_store = dist.PrefixStore(f"{prefix}/{adapter.name}", store)
    with long_store_call():
        comm = adapter.connect(gen_store, rank, size, timeout)
    return Generation(None, rank, size, handles, global_ranks, comm, gen_store, fire_abort_hooks)

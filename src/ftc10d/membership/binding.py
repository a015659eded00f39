"""How a :class:`~ftc10d.membership.Member` drives the ProcessGroups attached to it.

One concern, split from ``member.py``: moving a group onto a configuration
(:meth:`~GroupBinding.sync`, :meth:`~GroupBinding.apply`), aborting it when a
configuration makes its live one stale (a member dropped, this member fenced, or
a newer one while it recovers: :meth:`~GroupBinding.recovering`), and turning its
data-path failures into reports. A mixin: :class:`~ftc10d.membership.Member` owns
the state named below and calls these from its API and its watch thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ftc10d.membership.agreement import Agreement, Configuration
from ftc10d.types import (
    ErrorType,
    MembershipError,
    MembershipTimeoutError,
    PeerFailureError,
    ReconfigureAbandonedError,
    ReconfigureConnectError,
    ReconfigureTimeoutError,
    StoreUnavailableError,
    UuidReusedError,
)

if TYPE_CHECKING:
    from ftc10d.membership.member import Member

logger = logging.getLogger("ftc10d")
_SUCCESS = ErrorType.SUCCESS

#: A member that misses this many rendezvous in a row of the newest configuration while
#: it still heartbeats is removed ("no-show"): its process lives, but the thread that
#: should reconfigure its group does not come (hung in user code, or in a library bug),
#: and without this the others would renew the same membership forever.
NO_SHOW_LIMIT = 2


class GroupBinding:
    """The group side of a :class:`~ftc10d.membership.Member` (module docstring)."""

    # owned by Member.__init__
    id: str
    heartbeat_timeout: float
    rendezvous_timeout: float
    _cv: threading.Condition
    _api_lock: threading.Lock
    _agreement: Agreement
    _current: Optional[Configuration]
    _fenced: Optional[BaseException]
    _closed: bool
    _pgs: list[Any]
    _reports: "queue.Queue[tuple[str, str]]"
    #: (group, configuration) while sync()/apply() waits in that configuration's rendezvous.
    _applying: Optional[tuple[Any, Configuration]]
    #: (group, configuration) while the caller's first collectives on that configuration
    #: run (:meth:`recovering`): a newer configuration aborts the group.
    _recovering: Optional[tuple[Any, Configuration]]
    #: member id -> rendezvous of the newest configuration it missed in a row (NO_SHOW_LIMIT)
    _no_shows: dict[str, int]

    def attach(self, pg: Any) -> "Member":
        """Connect ``pg`` to this member: a ``PeerFailureError`` naming a peer is reported
        at once (data-path detection), and when this member adopts a configuration that
        drops a member of ``pg``'s current one (or fences this member), ``pg`` is aborted
        so that ops stuck on the removed member fail now instead of at their timeout;
        the caller then calls :meth:`sync` (which raises ``Fenced`` if it was removed)."""
        pg.add_error_listener(lambda err: self._on_pg_error(pg, err))
        self._pgs.append(pg)
        return self

    @contextlib.contextmanager
    def recovering(self, pg: Any, cfg: Configuration) -> Iterator[None]:
        """While the caller runs its recovery's collectives on ``pg`` in ``cfg`` (just
        moved there by :meth:`sync`), any newer configuration aborts ``pg``, even one that only
        adds members.

        Why: outside a recovery a join does not abort a running step (its peers are all
        in it and finish it, then move on together). But a peer that adopted a newer
        configuration before it finished connecting ``cfg`` goes straight to the newer
        one and never issues ``cfg``'s recovery collectives, while a peer whose connect
        completed waits in them for a partner who will not come (chaos finding 35:
        15 s, until fenced). Aborted, it gets a ``CollectiveError`` and syncs again."""
        with self._cv:
            self._recovering = (pg, cfg)
            cur = self._current
            newer = cur is not None and cur.incarnation == cfg.incarnation and cur.epoch > cfg.epoch
        try:
            if newer:
                try:
                    self._abort_recovering(pg, cfg, cur)
                except Exception:
                    logger.warning("membership: could not abort %r", pg, exc_info=True)
            yield
        finally:
            with self._cv:
                self._recovering = None

    def _abort_recovering(self, pg: Any, old: Configuration, new: Optional[Configuration]) -> None:
        if pg.uuid != old.uuid or pg.get_error() != _SUCCESS:
            return  # already moved on or aborted
        logger.info("membership: %s aborts %r mid-recovery in %s: it holds %s, which its peers may have "
                    "gone to without finishing that one's recovery", self.id, pg, old, new)
        pg.abort()

    def _abort_stale(self, cfg: Optional[Configuration]) -> None:
        """Abort attached groups whose live configuration lost a member (or all of them:
        ``cfg`` None, once fenced or when the store lost its state), and a group still
        recovering in an older configuration (:meth:`recovering`). Never called with the
        member's condition held."""
        recovering = self._recovering
        if recovering is not None and cfg is not None and cfg.incarnation == recovering[1].incarnation \
                and cfg.epoch > recovering[1].epoch:
            try:
                self._abort_recovering(recovering[0], recovering[1], cfg)
            except Exception:
                logger.warning("membership: could not abort %r", recovering[0], exc_info=True)
        applying = self._applying
        if applying is not None and (cfg is None or applying[1].epoch < cfg.epoch):
            # sync() waits in the rendezvous of an older configuration, maybe for members that
            # went straight to this one: give it up now rather than at its timeout.
            logger.info("membership: %s gives up the rendezvous of %s", self.id, applying[1])
            abandon = getattr(applying[0], "abandon_reconfigure", None)
            if abandon is not None:  # also if its rendezvous has not begun yet (finding 16)
                abandon(applying[1].uuid, f"member {self.id} adopted a newer configuration")
            applying[0].abort()
        for pg in list(self._pgs):
            try:
                gen = pg.generation
                if gen is None or pg.get_error() != _SUCCESS:
                    continue
                if cfg is None or any(h not in cfg.handles for h in gen.handles):
                    logger.info("membership: %s aborts %r: %s", self.id, pg,
                                "its configuration is void" if cfg is None else f"{cfg} dropped a member")
                    pg.abort()
            except Exception:
                logger.warning("membership: could not abort %r", pg, exc_info=True)

    def _on_pg_error(self, pg: Any, err: Exception) -> None:
        """Runs on the failing op's thread, before its configuration is aborted: only enqueue."""
        if self._closed or self._fenced is not None or not isinstance(err, PeerFailureError) or err.peer is None:
            return
        gen = pg.generation
        if gen is None or gen.uuid != err.uuid or not 0 <= err.peer < len(gen.handles):
            return
        handle = gen.handles[err.peer]
        if handle != self.handle:
            self._reports.put((handle, "peer-error"))

    def report(self, handle: str, reason: str = "peer-error") -> None:
        """Suspect the member behind ``handle`` (asynchronous; proposed by the detect thread at once)."""
        self._reports.put((handle, reason))

    def report_exit(self, handle: str) -> Optional[Configuration]:
        """A supervisor saw the process behind ``handle`` exit: remove it now (confirmed)."""
        self.check()
        with self._api_lock:
            out = self._agreement.report_exit(handle)
        if out.config is not None:
            self._adopt(out.config)
        return out.config

    def apply(self, pg: Any, config: Optional[Configuration] = None, *,
              timeout: Optional[float] = None) -> Configuration:
        """Reconfigure ``pg`` to ``config`` (default: the newest held): ``ftc10d.reconfigure``
        with its uuid and ordered handles. A no-op if ``pg`` is already on it."""
        import ftc10d

        self.check()
        cfg = config if config is not None else self._current
        if cfg is None:
            raise MembershipError(f"member {self.id} holds no configuration yet; wait_next() first")
        if pg.uuid == cfg.uuid:
            return cfg
        with self._cv:
            cur = self._current
            if cur is not None and cur.incarnation == cfg.incarnation and cur.epoch > cfg.epoch:
                raise ReconfigureAbandonedError(f"{cfg} was superseded by epoch {cur.epoch} before its rendezvous; "
                                                "apply the newest configuration")
            self._applying = (pg, cfg)
        try:
            ftc10d.reconfigure(cfg.uuid, list(cfg.handles), group=pg,
                               timeout=None if timeout is None else timedelta(seconds=timeout))
        finally:
            with self._cv:
                self._applying = None
        return cfg

    def sync(self, pg: Any, timeout: Optional[float] = None) -> Configuration:
        """Bring ``pg`` onto the newest configuration and return it: the one call to make
        at start and after any ``CollectiveError``.

        Waits for admission if needed; applies the newest configuration; if ``pg`` is
        already on it but that configuration was aborted, waits briefly for the change
        that is surely coming (a removal) and otherwise asks for a fresh epoch with the
        same members; if a rendezvous fails (a member died before arriving: its uuid is
        burned), asks for a fresh epoch too. Raises ``Fenced`` or ``MembershipTimeoutError``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def left(cap: Optional[float] = None) -> Optional[float]:
            rest = None if deadline is None else max(0.0, deadline - time.monotonic())
            return cap if rest is None else rest if cap is None else min(cap, rest)

        if self._current is None:
            self.wait_next(0, left())
        failed: Optional[BaseException] = None  # the last rendezvous that failed
        while True:
            self.check()
            cfg = self._current
            assert cfg is not None
            if failed is not None and deadline is not None and time.monotonic() >= deadline:
                # Without this, a spent deadline gave each retry a 1-ms rendezvous that failed and
                # renewed the configuration: dozens of epochs a second, until the others came.
                raise MembershipTimeoutError(
                    f"member {self.id}: could not bring its group onto the newest configuration ({cfg}) within "
                    f"{timeout:g} s: {failed}. The others are probably not there yet: call sync() again with "
                    "a longer timeout (at least rendezvous_timeout)", status=self.status())
            if pg.uuid == cfg.uuid:
                if pg.get_error() == _SUCCESS:
                    return cfg
                try:  # aborted: the removal that caused it is normally agreed within a timeout
                    self.wait_next(cfg.epoch, left(2 * self.heartbeat_timeout))
                    continue
                except MembershipTimeoutError:
                    self._renew(cfg, "its configuration was aborted and no change followed")
                    self.wait_next(cfg.epoch, left())
                    continue
            wait = left(self.rendezvous_timeout)
            try:
                applied = self.apply(pg, cfg, timeout=max(wait or 0.0, 0.001))
                self._no_shows = {}
                return applied
            except ReconfigureAbandonedError as exc:
                # A newer configuration superseded cfg (adopted here, or by a member that went
                # straight to it and gave cfg's rendezvous up): it is in the store already.
                logger.info("membership: %s gave up %s: %s", self.id, cfg, exc)
                failed = exc
                self._renew(cfg, f"the rendezvous of epoch {cfg.epoch} was given up")
                self.wait_next(cfg.epoch, left())
            except (ReconfigureTimeoutError, ReconfigureConnectError, UuidReusedError) as exc:
                logger.warning("membership: %s could not connect %s (%s)", self.id, cfg, exc)
                failed = exc
                # a rendezvous cut short by this call's own deadline proves nobody a no-show
                full = wait is None or wait >= self.rendezvous_timeout
                no_shows = self._count_no_shows(cfg, getattr(exc, "missing_handles", ())) if full else {}
                self._renew(cfg, f"the rendezvous of epoch {cfg.epoch} failed", no_shows)
                self.wait_next(cfg.epoch, left())

    def _count_no_shows(self, cfg: Configuration, missing: tuple[str, ...]) -> dict[str, str]:
        """Members that missed ``NO_SHOW_LIMIT`` rendezvous in a row, to be removed.

        Only a rendezvous of the newest configuration counts: a member missing from an
        older one has usually gone straight to the newer one (not a failure)."""
        cur = self._current
        if cur is None or cur.epoch != cfg.epoch:
            return {}
        ids = {h: m for m, h in zip(cfg.members, cfg.handles) if m != self.id}
        self._no_shows = {ids[h]: self._no_shows.get(ids[h], 0) + 1 for h in missing if h in ids}
        out = {m: "no-show" for m, n in self._no_shows.items() if n >= NO_SHOW_LIMIT}
        for m in out:
            logger.warning("membership: %s: member %s missed %d rendezvous in a row while it heartbeats (a hung "
                           "training thread?); proposing its removal", self.id, m, self._no_shows[m])
        return out

    def _renew(self, cfg: Configuration, why: str, remove: Optional[dict[str, str]] = None) -> None:
        """Ask for a configuration after ``cfg`` (same members, fresh uuid; without ``remove``) unless one exists."""
        with self._api_lock:
            try:
                out = self._agreement.propose(remove, reason=f"{self.id}: {why}", renew_after=cfg.epoch)
            except StoreUnavailableError:
                return
        if out.config is not None:
            self._adopt(out.config)

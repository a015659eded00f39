"""The job's newest committed state, known to the membership: no second history (invariant 8).

A state is named by its identity ``(commit epoch, step)`` (:mod:`ftc10d.train.manager`).
The live ranks alone cannot tell whether their newest identity is the job's: a member
frozen past the heartbeat is removed, the others commit steps 41-55 in the next
configuration and are then all killed; the frozen one resumes holding step 40, and a
recovery that takes the newest state *among the live ranks* trains steps 41-55 a second
time, from an older state, without a word. So the membership keeps one fact, ``train``:

- ``reached``: a lower bound of the newest identity the job committed, and an exact one of
  its epoch. **Every rank records** ``(e, s)`` **before it applies its first step in
  configuration** ``e`` (:meth:`JobProgress.record`: one atomic merge, a maximum, once per
  configuration and rank, never per step), and a recovery refines it to the identity it
  continues from (the configuration that ended, as far as its survivors hold it).
- ``closed``: the identity at which a holder left on purpose (``Manager.close()``).

So that messages name the step the job really reached, not the first of its epoch, the first
rank of the committing ranks also reports its newest identity about once a second, from a
thread of its own (:class:`Reporter`): nothing on the step's path but an assignment.

Why nothing older than the job's newest state can become a recovery target:

1. Any state with commit epoch ``e`` was first applied, by whoever applied it, after that
   rank's merge of ``(e, s)`` returned: so while such a state exists or existed, the fact's
   epoch is at least ``e``. A state received from a peer keeps its source's identity, which
   was recorded the same way. A store restart that loses the fact does not lose it: every
   member that merged it merges it again (:meth:`ftc10d.membership.Member.merge_fact`).
2. Identities are ordered by epoch, then step, and epochs are unique and only grow (also
   across store restarts). A recovery adopts the greatest identity ``T`` among the live
   synchronized ranks only if ``T >= reached`` (:meth:`JobProgress.admits`). A stale rank
   (fenced, or frozen and resumed) holds an identity of an older epoch than any configuration
   that went on without it and committed, so it never passes, whatever its step counter says
   (a rank with an equal counter from a discarded history included).
3. Within one epoch the bound is the first step, not the last: a live rank of epoch ``e``
   that is behind the dead ones is behind by one step at most (a partial vote: the vote
   completed on some ranks and failed on others, and a rank that failed issues nothing more
   in ``e``), and the argument of invariant 1 rolls that step back rather than waiting for a
   holder (FT-HSDP rolls it forward when the gradients survive: ``Manager._roll_forward_to``).
   Nothing older passes.

When no live rank holds ``reached``, the job waits for the next configuration (a holder that
was merely fenced rejoins with its state) until ``Manager.sync_timeout``, then raises
:class:`ftc10d.StateLostError` naming the identity the job reached and what the live ranks
hold; or, if a holder closed at it, :class:`ftc10d.JobFinished` at once.

Cost: one store read per recovery and rank (as before), one merge per rank at its first
commit in each configuration, one by a single rank per recovery; per step, one comparison.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ftc10d.types import JobFinished, MembershipTimeoutError, StateLostError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

#: The membership fact's name.
FACT = "train"
#: How often a write that found the store unreachable is retried.
RETRY_S = 0.05

Identity = tuple[int, int]


def _identity(value: Any) -> Optional[Identity]:
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value)):
        return int(value[0]), int(value[1])
    return None


def merge(stored: Optional[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """The fact's merge: each field the greatest identity either side has (monotone)."""
    out = dict(stored or {})
    for name in ("reached", "closed"):
        new, old = _identity(body.get(name)), _identity(out.get(name))
        if new is not None and (old is None or new > old):
            out[name] = list(new)
    return out


def describe(ident: Optional[Identity]) -> str:
    return "nothing" if ident is None else f"step {ident[1]} of epoch {ident[0]}"


class Reporter:
    """Merges the newest identity :meth:`note` was given into the fact at most once per
    ``interval`` seconds, from a daemon thread (started at the first note): it keeps the
    recorded ``reached`` close to the job's real progress for the messages of JobFinished and
    StateLostError, at the cost of one assignment per step. Best effort: correctness rests on
    the record before each configuration's first commit, not on this. Only the configuration's
    first member writes (every rank commits the same steps): the store sees one reporter per
    job, not one per rank (issue 28)."""

    def __init__(self, member: Any, interval: float = 1.0) -> None:
        self.member = member  # the Manager swaps it when it rejoins
        self.interval = interval
        self._latest: Optional[Identity] = None
        self._written: Optional[Identity] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def note(self, ident: Identity) -> None:
        self._latest = ident
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ftc10d-progress", daemon=True)
            self._thread.start()
            # Stopped before the interpreter tears down: a daemon thread caught inside a TCPStore
            # call at finalization can abort the process ("terminate called without an active exception").
            atexit.register(self.close)

    def _loop(self) -> None:
        # A connection of its own: during a store outage this thread's merge waits out the
        # reconnect, and must not hold the member's connection (and lock) while it does.
        store = self.member.connection()
        try:
            while not self._stop.wait(self.interval):
                ident = self._latest
                if ident is None or ident == self._written:
                    continue
                cur = self.member._current
                if cur is None or not cur.members or cur.members[0] != self.member.id:
                    continue  # one reporter per job (the configuration's first member), not one per rank
                try:
                    self.member.merge_fact(FACT, {"reached": list(ident)}, merge, store=store)
                    self._written = ident
                except Exception as exc:  # noqa: BLE001 - best effort, see the class docstring
                    logger.debug("manager: could not report the job's progress %s: %s", ident, exc)
        finally:
            store.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


@dataclass(frozen=True)
class JobProgress:
    """What the membership knows of the job's committed state (see the module docstring)."""

    reached: Optional[Identity] = None
    closed: Optional[Identity] = None

    @classmethod
    def read(cls, member: Any) -> "JobProgress":
        """The fact now (one store read). Raises :class:`ftc10d.StoreUnavailableError`."""
        fact = member.fact(FACT) or {}
        return cls(_identity(fact.get("reached")), _identity(fact.get("closed")))

    @staticmethod
    def record(member: Any, reached: Identity, *, closed: bool = False, deadline: Optional[float] = None) -> None:
        """Merge ``reached`` (and, with ``closed``, the same identity as ``closed``) into the
        fact. With a ``deadline`` (``time.monotonic()``), retry an unreachable store until
        then; raises :class:`ftc10d.StoreUnavailableError` after it (or at once without one)."""
        body: dict[str, Any] = {"reached": list(reached)}
        if closed:
            body["closed"] = list(reached)
        while True:
            try:
                member.merge_fact(FACT, body, merge)
                return
            except StoreUnavailableError:
                if deadline is None or time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_S)

    def admits(self, target: Optional[Identity]) -> bool:
        """Whether a recovery may continue the job from ``target`` (the greatest identity among
        the live synchronized ranks; None: no such rank)."""
        return self.reached is None or (target is not None and target >= self.reached)

    @property
    def finished(self) -> bool:
        """A holder of the job's newest state closed there: nobody will come back with it."""
        return self.closed is not None and self.reached is not None and self.closed >= self.reached


def wait_for_holder(manager: Any, cfg: Any, progress: JobProgress, held: Sequence[Optional[Identity]],
                    deadline: float) -> None:
    """No live rank of configuration ``cfg`` holds the job's newest state ``progress.reached``
    (``held``: each rank's identity, None for a rank with no state). Going on would train a
    second history, so: :class:`ftc10d.JobFinished` at once if its holders closed there (they
    will not be back); otherwise wait for the next configuration (a holder that was fenced
    rejoins with its state) and return, so that the caller plans again; after
    ``manager.sync_timeout``, :class:`ftc10d.StateLostError`."""
    reached = progress.reached
    assert reached is not None
    best = max((h for h in held if h is not None), default=None)
    holds = describe(best) if best is None else f"at most {describe(best)}"
    step_held = -1 if best is None else best[1]
    if progress.finished:
        logger.warning("manager: the job finished at %s while this process was out of it (the live ranks hold %s): "
                       "nothing left to train", describe(reached), holds)
        manager._emit("job_finished", epoch=cfg.epoch, job_step=reached[1], job_epoch=reached[0], held=step_held)
        raise JobFinished(
            f"the job finished at {describe(reached)} while this process was out of it: the members that held "
            f"that state closed, and the members of epoch {cfg.epoch} hold {holds}. There is nothing left to "
            "train: call Manager.close() and exit with status 0", step=reached[1], held=step_held)
    logger.error("manager: no member of epoch %d holds the job's newest committed state (%s; the live ranks hold "
                 "%s); waiting for a holder instead of training a second history from there", cfg.epoch,
                 describe(reached), holds)
    manager._emit("state_lost", epoch=cfg.epoch, job_step=reached[1], job_epoch=reached[0], held=step_held,
                  held_epoch=-1 if best is None else best[0])
    try:
        manager.member.wait_next(cfg.epoch, timeout=max(deadline - time.monotonic(), 0.001))
    except MembershipTimeoutError:
        raise StateLostError(
            f"the job committed {describe(reached)} (the newest state it reached, or later in that epoch), but "
            f"no member of epoch {cfg.epoch} holds it (they hold {holds}) and none came back within "
            f"{manager.sync_timeout:g} s: every member that held it is gone. Training on from an older state would "
            "redo committed steps (a second history), so the job stops: restore from a checkpoint or restart "
            "it") from None

"""The step-commit Manager: a step is applied by every participant or by none.

Per step, two calls (``ManagedOptimizer`` makes them for you):

- :meth:`Manager.start_step` — if the membership moved on (a member was removed
  or admitted) or the last step failed, reconfigure the group onto the newest
  configuration, then bring every rank that is behind (a joiner, a member that
  was fenced and rejoined, a survivor that missed a commit) up to the most
  advanced committed state over the group (:mod:`ftc10d.train.recovery`).
- :meth:`Manager.should_commit` — the vote: one all-reduce of ``(failed, newest
  epoch seen)``: the step commits only if no participant failed, and every
  participant learns the newest configuration epoch anyone saw, so that all
  of them switch configuration at the same step boundary (a rank that switched
  alone would leave the others waiting in a collective on the old one).

With DDP (``vote="fused"``, the default) the vote rides on the last gradient
bucket's all-reduce: a few more elements in a message that is sent anyway, so
a step with no failure costs no extra round trip (a separate small all-reduce
is one network latency per step: 1.2x the step time of plain DDP on a small
model, measured). The price: a rank can only veto a step before that bucket is
reduced (:meth:`Manager.veto`, before ``backward()``). Steps that reduce no
gradients (``no_sync``), and ``vote="separate"``, vote with their own all-reduce.

Why every survivor ends each step with the same state (invariant 1), whatever a
collective does when a peer dies half way (some ranks complete it, others fail):

1. *A rank commits only what the whole configuration computed.* It applies step
   ``s`` only if every collective of the step completed **on this rank** and the
   vote passed. A failure of any of them, whatever the exception type (torch's
   ``Future.then`` turns our typed errors into ``RuntimeError``; the abort that
   follows runs on another thread), is recorded and the step is not applied; the
   rank then issues nothing more on that configuration (an op the others did not
   issue would pair with their next one) and aborts it. A completed all-reduce
   gives the same sum on every rank that completed it, so all ranks that commit
   step ``s`` in one configuration apply the same update to the same state.
2. *A state is named by its identity* ``(commit epoch, step)``: ``step`` counts the
   applied steps, ``commit epoch`` is the membership epoch of the configuration in
   which the last of them was committed (a received state keeps its source's).
   Epochs are unique and increase, also across a store restart. By (1) and
   induction over configurations (each starts from one state, see 3), two
   synchronized ranks with the same identity hold bitwise-identical state.
3. *At every configuration change, before anyone computes,* the ranks exchange
   identities and every rank whose identity differs from the greatest one
   (ordered by epoch, then step) receives that state (:mod:`ftc10d.train.recovery`).
   Inside one configuration a rank can be ahead of another by one step at most
   (a partial vote: the ranks that did not commit abort it, so no later step can
   complete there): same epoch, higher step, it is the source and the step ends up
   applied by all. A rank whose last commit is from an older configuration than
   someone else's is on a history the job did not continue (it applied a step
   alone, was left out, and the others redid that step without it: equal
   counters, different states): it receives the newer state, i.e. its step is
   rolled back (``recovered`` event with ``rolled_back``). Either way every step
   ends up applied by all the survivors or by none.
4. *Checked, not only argued:* after each configuration change every rank's
   ``(fingerprint, step, commit epoch)`` is compared in one all-reduce, and every
   ``check_every`` steps (default 100) the fingerprints ride on the vote (a few
   elements more). Any difference, whatever its cause (a bug, a bit flip, a
   non-deterministic update), raises :class:`ftc10d.ReplicaDivergenceError` on
   every rank, naming the ranks and member ids that differ from the majority,
   instead of training on with different models.

Why no recovery ever continues from a state older than the newest the job committed
(invariant 8: no second history), which (3) alone does not give when every holder of the
newest state is gone and an older one comes back (a member frozen past the heartbeat, resumed
after the others who went on without it died): the membership records each configuration's
epoch before any rank applies its first step there, and a recovery continues only from an
identity at least that new, else waits for a holder and raises ``StateLostError``. The
argument, and its one exception (a partial vote whose every committer died is redone, as in
3), are in :mod:`ftc10d.train.progress`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ftc10d.membership import Member
from ftc10d.pg.channels import control, parse
from ftc10d.train.consistency import (
    FP_WORDS,
    exchange_identities,
    fingerprint48,
    groups_by_class,
    groups_of,
    join_words,
    split_words,
)
from ftc10d.train.ddp import DistributedDataParallel
from ftc10d.train.progress import Identity, JobProgress, Reporter, wait_for_holder
from ftc10d.train.recovery import Plan, make_plan, transfer
from ftc10d.train.state import StateFormatError, fingerprint, state_hash
from ftc10d.types import (
    CollectiveError,
    ErrorType,
    Fenced,
    InvalidOptionError,
    ReconfigureAbandonedError,
    ReconfigureConnectError,
    ReconfigureTimeoutError,
    ReplicaDivergenceError,
    StoreUnavailableError,
)

logger = logging.getLogger("ftc10d")
#: FT-HSDP's sub-groups could not follow the world's reconfigure: a recovery to start over.
_SUBGROUP_MOVE_ERRORS = (ReconfigureAbandonedError, ReconfigureTimeoutError, ReconfigureConnectError)

Listener = Callable[[str, dict[str, Any]], None]

_RESERVED = "ftc10d"
#: The registered state of an FT-HSDP rank (its local shards, Manager.fsdp).
_HSDP = "hsdp"
#: The world group's abort hook that aborts the FT-HSDP groups with it.
_HSDP_ABORT_HOOK_ID = 0x7FC10E


class Manager:
    """Coordinates one rank's training steps with the membership.

    Args:
        pg: this rank's ftc10d ``ProcessGroup`` (configured or not).
        member: its :class:`ftc10d.membership.Member` (joined, attached to ``pg``).
        rejoin_if_fenced: a member removed while frozen rejoins as a new member and
            receives the state again (instead of raising :class:`ftc10d.Fenced`).
        sync_timeout: bound (s) of waiting for a usable configuration in ``start_step``.
        vote: ``"fused"`` (default): with DDP, the commit vote travels with the last
            gradient bucket; ``"separate"``: always a vote all-reduce of its own.
    """

    def __init__(self, pg: Any, member: Member, *, rejoin_if_fenced: bool = True,
                 sync_timeout: float = 300.0, vote: str = "fused", check_every: int = 100,
                 hsdp: Any = None) -> None:
        if vote not in ("fused", "separate"):
            raise InvalidOptionError(f"vote={vote!r}: choose 'fused' (with the gradients) or 'separate'")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise InvalidOptionError(f"check_every={check_every!r}: a number of steps >= 0 (0: compare the replicas' "
                                     "fingerprints only at configuration changes)")
        #: FT-HSDP (``ftc10d.train.fsdp.HSDPGroups``), or None for DDP / replicated training.
        self.hsdp = hsdp
        if hsdp is not None:
            from ftc10d.pg.c10d import set_default_group

            set_default_group(pg)  # torch's DeviceMesh reads the default group
            vote = "separate"  # the fused vote rides on DDP's last bucket; FSDP2 has none
            pg.register_abort_hook(_HSDP_ABORT_HOOK_ID, hsdp.abort)  # a dead peer's replica-mates stop at once
            # FSDP2's forward and backward must run to their end (an exception half-way leaves its
            # state machine half-way): the shard group's failures are reported here, not raised.
            hsdp.shard.swallow_errors(self._hook_failed)
        elif vote == "fused" and parse(pg.adapter_name) is not None:
            # A two-channel group: the gradients are on the device channel, the vote belongs on the
            # CPU one (a fused vote would copy the last bucket to the host, and ride on NCCL).
            logger.info("manager: vote='separate' on the two-channel group %s (the vote runs on its CPU channel)",
                        pg.adapter_name)
            vote = "separate"
        self.vote = vote
        self.check_every = check_every
        self.pg = pg
        self.member = member
        self.rejoin_if_fenced = rejoin_if_fenced
        self.sync_timeout = sync_timeout
        #: Number of committed steps (restored on joiners with the rest of the state).
        self.step = 0
        #: Membership epoch of the configuration that committed the last applied step (with
        #: ``step``, the identity of the state: see the module docstring).
        self.commit_epoch = 0
        #: Epoch of the configuration ``pg`` was last synchronized onto by this Manager.
        self._cfg_epoch = 0
        #: This rank's fingerprint words, when this step's vote compares the replicas.
        self._check: Optional[list[int]] = None
        self._synced = False
        self._exchanged_uuid: Optional[int] = None
        self._target_epoch = 0
        self._error: Optional[BaseException] = None
        self._states: dict[str, tuple[Callable[[], Any], Callable[[Any], None], Any]] = {}
        self._listeners: list[Listener] = []
        self._ddps: list[DistributedDataParallel] = []
        self._vote_opts = dist.AllreduceOptions()
        self._vote_opts.reduceOp = dist.ReduceOp.MAX
        #: (anyone failed, newest epoch, every rank's fingerprint or None) from this step's
        #: fused vote, once it completed.
        self._fused: Optional[tuple[bool, int, Optional[list[int]]]] = None
        self._vetoed: Optional[str] = None
        #: The configuration epoch this rank last recorded as the job's (JobProgress.record):
        #: it records each configuration's, before applying its first step there.
        self._recorded_epoch = -1
        self._reporter = Reporter(member)
        #: FT-HSDP: a state received before Manager.fsdp() registered the model (a replacement).
        self._pending_state: Optional[dict[str, Any]] = None
        #: FT-HSDP: the optimizer registered by fsdp(), which a roll forward steps.
        self._fsdp_optimizer: Optional[torch.optim.Optimizer] = None
        #: FT-HSDP: ``(epoch of the configuration, step)`` of a step this rank computed without
        #: any failure and voted for, whose vote then failed here: see _roll_forward_to.
        self._voted_yes: Optional[tuple[int, int]] = None
        #: True while this rank's vote all-reduce is being issued (fault-injection tests use it).
        self.in_vote = False
        #: Fault injection (tests, chaos): called on this rank once its vote's collective completed,
        #: before the outcome is read; a ``CollectiveError`` it raises becomes this rank's outcome.
        #: It reproduces on purpose what Gloo does by chance when a peer dies mid-operation: the vote
        #: completed on some ranks and failed on others.
        self.after_vote: Optional[Callable[[], None]] = None

    # ---------------------------------------------------------------- state

    def register(self, name: str, obj: Any = None, *, state_dict: Optional[Callable[[], Any]] = None,
                 load_state_dict: Optional[Callable[[Any], None]] = None) -> None:
        """Include ``obj.state_dict()`` (or ``state_dict()``) in what joiners receive.

        Values must be tensors, dicts, lists, tuples, numbers, strings or None
        (nothing is pickled). Register the same names in the same order on every rank.
        """
        if not isinstance(name, str) or not name or name == _RESERVED:
            raise InvalidOptionError(f"state name {name!r} is invalid (non-empty str, not {_RESERVED!r})")
        if name in self._states:
            raise InvalidOptionError(f"state {name!r} is already registered")
        if obj is not None:
            if state_dict is not None or load_state_dict is not None:
                raise InvalidOptionError("pass either an object or state_dict=/load_state_dict=, not both")
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise InvalidOptionError(f"{name!r}: {type(obj).__name__} has no state_dict()/load_state_dict()")
            state_dict, load_state_dict = obj.state_dict, obj.load_state_dict
        elif state_dict is None or load_state_dict is None:
            raise InvalidOptionError(f"{name!r}: give an object, or both state_dict= and load_state_dict=")
        self._states[name] = (state_dict, load_state_dict, obj)

    def registered(self, obj: Any) -> bool:
        return any(o is obj or (isinstance(o, tuple) and any(x is obj for x in o)) for _, _, o in self._states.values())

    def state_dict(self) -> dict[str, Any]:
        """Everything a joiner receives: the registered states and the committed step."""
        out: dict[str, Any] = {_RESERVED: {"step": self.step, "epoch": self.commit_epoch}}
        for name, (get, _, _) in self._states.items():
            out[name] = get()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._voted_yes = None
        if self.hsdp is not None and not self.registered_fsdp and _HSDP in state:
            self._pending_state = state  # a replacement before Manager.fsdp(): applied there
            self.step = int(state[_RESERVED]["step"])
            self.commit_epoch = int(state[_RESERVED].get("epoch", 0))
            return
        missing = [n for n in [_RESERVED, *self._states] if n not in state]
        extra = [n for n in state if n != _RESERVED and n not in self._states]
        if missing or extra:
            raise StateFormatError(f"received state does not match the registered names: missing {missing}, "
                                   f"unexpected {extra}; register the same names on every rank")
        for name, (_, load, _) in self._states.items():
            load(state[name])
        self.step = int(state[_RESERVED]["step"])
        self.commit_epoch = int(state[_RESERVED].get("epoch", 0))

    def fingerprint(self) -> str:
        """Equal on two replicas iff (almost surely) their states are bitwise equal; cheap."""
        return fingerprint(self.state_dict())

    def state_hash(self) -> str:
        """sha256 of the whole state (skeleton and bytes)."""
        return state_hash(self.state_dict())

    # ---------------------------------------------------------------- views

    @property
    def rank(self) -> int:
        return int(self.pg.rank())

    @property
    def world_size(self) -> int:
        return int(self.pg.size())

    @property
    def epoch(self) -> int:
        cur = self.member._current
        return cur.epoch if cur is not None else 0

    def add_listener(self, fn: Listener) -> None:
        """``fn(kind, info)`` on reconfigured / recovered / sent_state / aborted_step / fenced / state_lost /
        job_finished."""
        self._listeners.append(fn)

    def _emit(self, kind: str, **info: Any) -> None:
        for fn in list(self._listeners):
            try:
                fn(kind, info)
            except Exception:
                logger.exception("manager listener failed on %s", kind)

    # ---------------------------------------------------------------- FT-HSDP

    @property
    def registered_fsdp(self) -> bool:
        return _HSDP in self._states

    @property
    def awaiting_model(self) -> bool:
        """FT-HSDP: True on a replacement between :meth:`device_mesh` (where it received its
        shards' state from a live rank) and :meth:`fsdp` (where that state is applied). Its
        model's initial values are overwritten then: it may skip initialising them, and must
        not run collectives on the shard group to do so (its peers are training)."""
        return self._pending_state is not None

    def device_mesh(self) -> Any:
        """FT-HSDP: the 1-D ``DeviceMesh`` of this rank's shard group, for
        ``fully_shard(module, mesh=...)``. Waits for a configuration in which this rank's
        replica is complete (and recovers there, see :func:`ftc10d.train.fsdp.recover_shards`).
        Then build the model, shard it, and call :meth:`fsdp`."""
        if self.hsdp is None:
            raise InvalidOptionError("device_mesh() needs a Manager created with hsdp=HSDPGroups(...)")
        if self._exchanged_uuid is None or self._exchanged_uuid != self.pg.uuid:
            self._recover()
        return self.hsdp.mesh

    def fsdp(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """FT-HSDP: register the FSDP2-sharded ``model`` and its ``optimizer`` as this rank's
        state (their local shards: what a rank of the same shard index sends a replacement),
        and route each FSDP module's cross-replica all-reduce through the replicate group."""
        from ftc10d.train.fsdp import load_local_state, local_state

        if self.hsdp is None:
            raise InvalidOptionError("fsdp() needs a Manager created with hsdp=HSDPGroups(...)")
        hook = self.hsdp.all_reduce_hook(self._hook_failed)
        sharded = [m for m in model.modules() if callable(getattr(m, "set_all_reduce_hook", None))]
        if not sharded:
            raise InvalidOptionError("fsdp(): no module of the model was sharded: call torch's fully_shard(module, "
                                     "mesh=manager.device_mesh()) on it first")
        for m in sharded:
            m.set_all_reduce_hook(hook)
        self._fsdp_optimizer = optimizer
        self._states[_HSDP] = (lambda: local_state(model, optimizer),
                               lambda st: load_local_state(model, optimizer, st), (model, optimizer))
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            self.load_state_dict(pending)

    def _hook_failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Wrap a step's forward and backward: a failed collective inside (FSDP2's all-gather
        or reduce-scatter on a group that lost a peer) fails the step (it will not commit)
        instead of raising out of the training loop; anything else is raised."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - decided by note_failure
            if not self.note_failure(exc):
                raise
            logger.info("manager: step %d failed in a collective: %s", self.step, exc)

    # ---------------------------------------------------------------- DDP

    def ddp(self, module: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
        """torch's DDP over this group (see :mod:`ftc10d.train.ddp`); registers ``module`` as
        state "model" unless it is registered already."""
        if not self.registered(module):
            self.register("model", module)
        wrapper = DistributedDataParallel(module, self, **ddp_kwargs)
        self._ddps.append(wrapper)
        return wrapper

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Average ``tensor`` over the current participants, in place. The future never
        fails: a failure is noted (the step will not commit) and the tensor returned."""
        if self._error is None:
            try:
                work = self.pg.allreduce([tensor])
            except (CollectiveError, RuntimeError) as exc:
                if not self.note_failure(exc):
                    raise  # bad input, not a failure: never hand back an unreduced tensor as reduced
            else:
                size = self.pg.size()
                return self._when_done(work, tensor, lambda: tensor.div_(size))
        return self._done(tensor)

    def allreduce_with_vote(self, tensor: torch.Tensor) -> torch.futures.Future:
        """:meth:`allreduce` of a flat float bucket that also carries this rank's commit vote
        (the last DDP bucket, under ``vote="fused"``): the bucket, one "failed" count and one
        epoch slot per rank, summed in one all-reduce. Falls back to :meth:`allreduce` for
        dtypes that cannot hold the vote exactly."""
        if (self.vote != "fused" or tensor.dtype not in (torch.float32, torch.float64) or tensor.dim() != 1
                or self._error is not None):
            return self.allreduce(tensor)
        n, size, me = tensor.numel(), self.pg.size(), self.pg.rank()
        check = self._check
        fp_at = n + 1 + size  # this step's fingerprint words, FP_WORDS per rank, when it compares replicas
        buf = torch.zeros(fp_at + (FP_WORDS * size if check is not None else 0), dtype=tensor.dtype)
        buf[:n].copy_(tensor)
        cur = self.member._current
        buf[n] = float(self._vetoed is not None)
        buf[n + 1 + me] = float(cur.epoch if cur is not None else 0)
        if check is not None:  # 16-bit words: exact in any float dtype that holds the vote
            buf[fp_at + FP_WORDS * me:fp_at + FP_WORDS * (me + 1)] = torch.tensor(check, dtype=tensor.dtype)
        self.in_vote = True
        try:
            work = self.pg.allreduce([buf])
        except (CollectiveError, RuntimeError) as exc:
            if not self.note_failure(exc):
                raise
            return self._done(tensor)
        finally:
            self.in_vote = False

        def finish() -> torch.Tensor:
            if self.after_vote is not None:
                try:
                    self.after_vote()
                except CollectiveError as exc:
                    self._error = self._error or exc
                    return tensor
            fps = None
            if check is not None:
                words = [int(w) for w in buf[fp_at:].tolist()]
                fps = [join_words(words[FP_WORDS * r:FP_WORDS * (r + 1)]) for r in range(size)]
            self._fused = (bool(buf[n].item() > 0), int(buf[n + 1:fp_at].max().item()), fps)
            return tensor.copy_(buf[:n]).div_(size)

        return self._when_done(work, tensor, finish)

    def _when_done(self, work: Any, tensor: torch.Tensor, finish: Callable[[], torch.Tensor]) -> torch.futures.Future:
        """``work``'s future, continued by ``finish`` on success; on failure the failure is
        recorded (the step will not commit) and ``tensor`` returned as it is: never fails.

        Any error of this future is a failure of the step's communication, whatever its
        type: torch's ``Future.then`` turns the typed ``CollectiveError`` into a plain
        ``RuntimeError``, and the configuration's abort runs on another thread, so neither
        the type nor ``get_error()`` can be relied on here. (Deciding by them once let a
        rank take a failed bucket's unreduced gradient as reduced and commit it while the
        vote, on Gloo's other worker thread, had passed: a diverged replica.)"""

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                fut.value()
            except Exception as exc:
                if self._error is None:
                    self._error = exc
                return tensor
            return finish()

        return work.get_future().then(done)

    @staticmethod
    def _done(tensor: torch.Tensor) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    def veto(self, reason: str = "vetoed by the caller") -> None:
        """Make this step not commit, on every participant. Under ``vote="fused"`` call it
        before ``loss.backward()`` (the vote is cast with the last gradient bucket); with
        ``vote="separate"`` any time before :meth:`should_commit`."""
        self._vetoed = reason

    def note_failure(self, exc: BaseException) -> bool:
        """Record a failure of this step's communication; False if it was not one (re-raise it)."""
        if (isinstance(exc, CollectiveError) or self.pg.get_error() != ErrorType.SUCCESS
                or (self.hsdp is not None and self.hsdp.failed())):
            if self._error is None:
                self._error = exc
            return True
        return False

    # ---------------------------------------------------------------- steps

    def start_step(self) -> None:
        """Begin a step: switch to a new configuration and recover state if needed."""
        self._error = None
        self._fused = None
        self._vetoed = None
        try:
            cur = self.member.current()
        except Fenced as exc:
            self._on_fenced(exc)
            cur = None
        if (cur is None or cur.uuid != self.pg.uuid or cur.epoch < self._target_epoch
                or self._exchanged_uuid != self.pg.uuid or self.pg.get_error() != ErrorType.SUCCESS):
            self._recover()
        # Every participant of this step holds the same committed step (recovery made them
        # equal), so all of them decide alike whether this step's vote compares the replicas.
        self._check = (split_words(self._fingerprint48())
                       if self.check_every and self.step % self.check_every == 0 else None)

    def should_commit(self, ok: bool = True) -> bool:
        """The vote: True on every participant that completes it iff no participant failed
        (or vetoed). ``ok=False`` vetoes, like :meth:`veto`; under ``vote="fused"`` a veto
        that comes after the gradients were reduced is too late for the others: the step is
        then applied here too (invariant 1 first), with a warning."""
        if not ok and self._vetoed is None:
            self._vetoed = "should_commit(ok=False)"
        self._voted_yes = None
        if (self._error is not None or self.pg.get_error() != ErrorType.SUCCESS
                or (self.hsdp is not None and self.hsdp.failed())):
            # This rank's communication failed: it issues nothing more on this configuration (an
            # op the others did not issue would pair with their next one) and aborts it, so that
            # whoever still waits in it fails now. The others decide alike or, if their vote
            # completed, commit: recovery then brings this rank to their step.
            return self._abort_step(f"the group failed during the step: {self._error or 'aborted'}")
        failed = int(self._vetoed is not None)
        fused, self._fused = self._fused, None
        if fused is not None:  # voted with the last gradient bucket
            anyone_failed, self._target_epoch = fused[0], max(self._target_epoch, fused[1])
            if fused[2] is not None:
                self._compare(fused[2], "in the commit vote")
            if anyone_failed:
                return self._abort_step("a participant vetoed the step")
            if failed:
                logger.warning("manager: step %d was vetoed here (%s) after it was voted with the gradients; it is "
                               "applied like on every other rank. Under vote='fused' call manager.veto() before "
                               "loss.backward(), or create the Manager with vote='separate'", self.step, self._vetoed)
            return self._commit()
        cur = self.member._current
        check = self._check
        group = self.pg if self.hsdp is None else self.hsdp.participants  # FT-HSDP: the replicas that train
        # (failed, epoch) and, when this step compares the replicas, one fingerprint slot per rank (MAX of 0s
        # and the one value written).
        vote = torch.zeros(2 + (group.size() if check is not None else 0), dtype=torch.int64)
        vote[0], vote[1] = failed, cur.epoch if cur is not None else 0
        if check is not None:
            vote[2 + group.rank()] = join_words(check)
        self.in_vote = True
        try:
            with control():  # a two-channel group: the vote runs on its CPU channel (ftc10d.pg.channels)
                group.allreduce([vote], self._vote_opts).wait()
            if self.after_vote is not None:
                self.after_vote()
        except CollectiveError as exc:
            self._error = exc
            if self.hsdp is not None and not failed:
                self._voted_yes = (self._cfg_epoch, self.step)
            return self._abort_step(f"the vote failed: {exc}")
        finally:
            self.in_vote = False
        self._target_epoch = int(vote[1])
        if check is not None:
            fps = [int(v) for v in vote[2:].tolist()]
            # participants are ordered by (replica, shard index): position p holds shard index p % S
            if self.hsdp is None:
                self._compare(fps, "in the commit vote")
            else:
                self._compare(fps, "in the commit vote", [p % self.hsdp.layout.shard_size for p in range(len(fps))],
                              self.hsdp.placement.participants)
        if int(vote[0]):
            return self._abort_step(str(self._error) if self._error is not None
                                    else f"a participant voted against committing ({self._vetoed or 'not this one'})")
        return self._commit()

    def _roll_forward_to(self, epoch: int, step: int) -> bool:
        """FT-HSDP: apply, at recovery, the step whose vote failed on this rank but completed
        on others; True if it did.

        Why it is sound: a vote all-reduce completes only with every participant's
        contribution, and a participant contributes only after every collective of its step
        completed without failure and with a yes (a rank that failed or vetoed sends nothing,
        or a no). So if any rank committed step ``s`` of configuration ``e``, every
        participant of ``e`` holds step ``s``'s fully reduced gradients, bitwise the ones the
        committers applied, and this rank's optimizer stepping with them reaches the
        committers' state. Why it is needed: FSDP2 gives a shard index no spare copy, so
        when every holder of shard ``i`` missed the vote and a holder of shard ``j`` applied
        it, a transfer could bring nobody to one step of the job (``StateLostError``), and
        rolling the others back would need the previous state kept on every rank. The
        gradients stay until ``ManagedOptimizer.zero_grad()``, which recovers first."""
        if self._voted_yes != (epoch, step - 1) or self.step != step - 1 or self._fsdp_optimizer is None:
            return False
        params = [p for g in self._fsdp_optimizer.param_groups for p in g["params"]]
        if any(p.grad is None for p in params if p.requires_grad):
            logger.warning("manager: step %d was committed by others but this rank's gradients are gone (zeroed "
                           "before ManagedOptimizer.zero_grad()?): it cannot roll forward", self.step)
            return False
        self._fsdp_optimizer.step()
        self._voted_yes = None
        self.step, self.commit_epoch = step, epoch
        logger.info("manager: rolled forward to step %d of epoch %d (its vote failed here, completed elsewhere)",
                    step, epoch)
        self._emit("rolled_forward", step=step, epoch=epoch)
        return True

    def _commit(self) -> bool:
        """The vote passed: the step is applied here, in the current configuration. Its first
        step there is recorded with the membership first (:mod:`ftc10d.train.progress`): if
        the store stays unreachable for ``sync_timeout``, the step is not applied here (the
        others may apply it: a partial vote, which recovery evens out)."""
        if self._recorded_epoch != self._cfg_epoch:
            try:
                JobProgress.record(self.member, (self._cfg_epoch, self.step + 1),
                                   deadline=time.monotonic() + self.sync_timeout)
            except StoreUnavailableError as exc:
                self._error = exc
                return self._abort_step(f"the job's progress could not be recorded before applying the first step "
                                        f"of epoch {self._cfg_epoch}: {exc}")
            self._recorded_epoch = self._cfg_epoch
        self.step += 1
        self.commit_epoch = self._cfg_epoch
        if (self.pg if self.hsdp is None else self.hsdp.participants).rank() == 0:
            self._reporter.note((self.commit_epoch, self.step))
        return True

    def _fingerprint48(self) -> int:
        return fingerprint48(self.fingerprint())

    def _compare(self, fps: list[int], where: str, classes: Optional[list[int]] = None,
                 ranks: Optional[list[int]] = None) -> None:
        """Raise :class:`ReplicaDivergenceError` on every rank if the replicas' fingerprints
        (one per rank, all ranks see the same list) differ (:mod:`ftc10d.train.consistency`);
        with ``classes`` (FT-HSDP: each rank's shard index), only ranks of one class are compared;
        ``ranks``: the group rank of each entry (default: its position)."""
        groups, odd = groups_of(fps) if classes is None else groups_by_class(fps, classes)
        if not odd:
            return
        if ranks is not None:
            groups = {k: [ranks[i] for i in v] for k, v in groups.items()}
            odd = [ranks[i] for i in odd]
        cur = self.member._current
        ids = list(cur.members) if cur is not None and cur.epoch == self._cfg_epoch else []
        members = [ids[r] if r < len(ids) else "?" for r in odd]
        self._emit("diverged", step=self.step, epoch=self._cfg_epoch, groups=groups, ranks=odd, members=members)
        msg = (f"replicas diverged: {where} of step {self.step} (epoch {self._cfg_epoch}), the {len(fps)} ranks hold "
               f"{len(groups)} distinct states (fingerprint: ranks {groups}); ranks {odd} (members {members}) differ "
               "from the most common one. Training on would average gradients of different models, so the job "
               "stops here: restore from a checkpoint or restart it. Check that every registered state is the same "
               "on every replica (no per-rank values) and that the update is deterministic; otherwise report it "
               "with the event logs")
        logger.error("manager: %s", msg)
        raise ReplicaDivergenceError(msg, step=self.step, groups=groups, ranks=odd, members=members)

    def _abort_step(self, why: str) -> bool:
        if self._error is not None and self.pg.get_error() == ErrorType.SUCCESS:
            # This rank's communication failed but its configuration is not aborted (yet: the
            # abort may still run on another thread). Abort it now: the step must be redone on
            # a fresh configuration, never resumed on this one out of step with the others.
            self.pg.abort()
        logger.info("manager: step %d not committed: %s", self.step, why)
        self._emit("aborted_step", step=self.step, epoch=self._cfg_epoch, error=why)
        return False

    def _on_fenced(self, exc: Fenced) -> None:
        self._emit("fenced", epoch=exc.epoch, error=str(exc))
        if not self.rejoin_if_fenced:
            raise exc
        self.member = self._reporter.member = self.member.rejoin().attach(self.pg)
        # Its state is a state the job committed, but maybe not the newest: it is a source only
        # if nobody went on without it (its identity is still the job's newest, JobProgress);
        # otherwise it receives, or the job waits for a holder and then raises StateLostError.
        logger.warning("manager: fenced at epoch %s; rejoined as member %s", exc.epoch, self.member.id)

    def _recover(self) -> None:
        """Until it succeeds: newest configuration, reconfigure, plan, transfer, compare the
        replicas, rebuild DDP."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.sync_timeout
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                cur = self.member._current
                if cur is not None and cur.epoch < self._target_epoch:
                    self.member.wait_next(self._target_epoch - 1, timeout=left)
                cfg = self.member.sync(self.pg, timeout=left)
                self._cfg_epoch = cfg.epoch
                # a newer configuration aborts the group meanwhile: its peers may skip this one (finding 35)
                with self.member.recovering(self.pg, cfg):
                    if not self._recover_in(cfg, deadline):
                        continue
            except Fenced as exc:
                self._on_fenced(exc)
                continue
            except (CollectiveError, *_SUBGROUP_MOVE_ERRORS) as exc:
                # Reconfigure*: FT-HSDP's sub-groups could not move with the world (given up when it aborted,
                # or a peer never came): their uuid is spent, so the world must move on too (sync renews it)
                logger.warning("manager: recovery interrupted (%s); waiting for the next configuration", exc)
                if not isinstance(exc, CollectiveError) and self.pg.get_error() == ErrorType.SUCCESS:
                    self.pg.abort()
                continue
            except StoreUnavailableError as exc:  # the job's progress could not be read: sync again
                logger.warning("manager: recovery interrupted (%s); retrying", exc)
                time.sleep(0.05)
                continue
            self._finish_recovery(cfg, t0)
            return

    def _recover_in(self, cfg: Any, deadline: float) -> bool:
        """One recovery in ``cfg`` (``pg`` is on it): plan, transfer, compare the replicas.
        False when the job cannot go on in ``cfg`` (this rank waited for the next one)."""
        if self.hsdp is not None:
            from ftc10d.train.fsdp import recover_shards

            return recover_shards(self, cfg, deadline)  # False: this rank's replica is incomplete
        plan = make_plan(self.pg, self.step, self._synced, self.commit_epoch, JobProgress.read(self.member))
        if not self._continues(cfg, plan.job, plan.target, plan.held, plan.source, deadline):
            return False
        # A rank that was never synced (a joiner) may be overwritten while its state arrives.
        state, nbytes, secs = transfer(self.pg, plan, self.state_dict, None if self._synced else self.state_dict)
        self._received(plan, state, nbytes, secs)
        self._verify_replicas()
        return True

    def _finish_recovery(self, cfg: Any, t0: float) -> None:
        self._exchanged_uuid = self.pg.uuid
        self._target_epoch = max(self._target_epoch, cfg.epoch)
        for wrapper in self._ddps:
            wrapper.rebuild()
        self._emit("reconfigured", epoch=cfg.epoch, uuid=cfg.uuid, rank=self.rank, world_size=self.world_size,
                   seconds=time.perf_counter() - t0)

    def _received(self, plan: Plan, state: Optional[dict[str, Any]], nbytes: int, secs: float) -> None:
        """Adopt the state a transfer brought (if any) and say what moved."""
        if plan.diverged and self.rank in plan.diverged + [plan.source]:
            logger.warning("manager: rank(s) %s applied %d steps, the last in epoch(s) %s, but the job went on from "
                           "the state committed in epoch %d (rank %d): their last step is rolled back",
                           plan.diverged, plan.step, sorted({plan.epochs[r] for r in plan.diverged}), plan.epoch,
                           plan.source)
        if state is not None:
            before = (self.step, self.commit_epoch)
            self.load_state_dict(state)
            extra = {"rolled_back": list(before)} if self.rank in plan.diverged or before[0] > self.step else {}
            self._emit("recovered", source=plan.source, bytes=nbytes, seconds=secs, step=self.step,
                       epoch=self.commit_epoch, **extra)
            logger.info("manager: received state of step %d from rank %d (%d bytes, %.1f ms)",
                        self.step, plan.source, nbytes, secs * 1000)
        elif plan.needed and self.rank == plan.source:
            self._emit("sent_state", to=plan.recipients, bytes=nbytes, seconds=secs, step=self.step)
        self._synced = True

    def _verify_replicas(self) -> None:
        """After a configuration change: every rank's (fingerprint, step, commit epoch) in one
        all-reduce; any difference raises :class:`ReplicaDivergenceError` on every rank."""
        ids = exchange_identities(self.pg, self._fingerprint48(), self.step, self.commit_epoch)
        self._compare(ids, "after the configuration change")

    def _continues(self, cfg: Any, progress: JobProgress, target: Optional[Identity], held: list[Optional[Identity]],
                   writer: int, deadline: float) -> bool:
        """Whether configuration ``cfg`` may continue the job from ``target`` (the greatest
        identity of its live synchronized ranks; ``held``: each rank's): only if it is at least
        the newest state the job committed, ``progress`` (:mod:`ftc10d.train.progress`, as the
        ranks agreed on it in the plan's exchange: every rank decides alike). If so, rank
        ``writer`` (one per configuration) refines the record to ``target``; if not, the job
        waits for a holder (False: plan again), or raises JobFinished / StateLostError."""
        if not progress.admits(target):
            wait_for_holder(self, cfg, progress, held, deadline)
            return False
        if target is not None and self.rank == writer and (progress.reached is None or target > progress.reached):
            try:  # only makes the record (and its messages) more precise: never worth a wait
                JobProgress.record(self.member, target)
            except StoreUnavailableError as exc:
                logger.warning("manager: could not refine the job's progress to %s (%s)", target, exc)
        return True

    def close(self) -> None:
        """Record the step reached, and leave the membership (the others need not wait for a
        heartbeat timeout)."""
        self._reporter.close()
        if self._synced and self.step > 0:
            try:
                JobProgress.record(self.member, (self.commit_epoch, self.step), closed=True)
            except StoreUnavailableError as exc:
                logger.warning("manager: could not record that the job closed at step %d (%s)", self.step, exc)
        self.member.close(leave=True)


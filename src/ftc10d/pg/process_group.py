"""The fault-tolerant ``ProcessGroup``: torch 2.14's reconfigure contract on Gloo.

Every op goes through :meth:`ProcessGroup._issue`: fire pre-hooks, take the next
sequence number of the current generation, hand the op to that generation's
backend, wrap the backend's work, fire post-hooks. The public methods only
normalise torch's many calling conventions into that one call.

Method names follow torch's ``ProcessGroup`` (2.13 and 2.14 both call
``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``; older
callers use ``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``),
so ``torch.distributed``'s functions, ``DistributedDataParallel`` and the C++
callers that reach Python through torch's ``PyProcessGroup`` trampoline all land
here.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from ftc10d.pg import backend as _backend
from ftc10d.pg import handles as _handles
from ftc10d.pg import profiling as _profiling
from ftc10d.pg import signature as _signature
from ftc10d.pg.generation import Generation, is_communication_failure
from ftc10d.pg.rendezvous import PendingRendezvous, SideConnection, bootstrap, claim_uuid, rendezvous
from ftc10d.pg.hooks import HookRegistry
from ftc10d.pg.observer import GROUP_CREATED, OpObserver
from ftc10d.pg.work import CompletedWork, MultiWork, SwallowedWork, Work
from ftc10d.types import (
    CollectiveError,
    CollectiveMismatchError,
    ErrorType,
    HookOpName,
    InvalidOptionError,
    NotConfiguredError,
    UuidReusedError,
    make_post_hook_args,
    make_pre_hook_args,
)

logger = logging.getLogger("ftc10d")

DEFAULT_TIMEOUT = timedelta(minutes=5)
_NO_TIMEOUT = timedelta(0)
_group_ids = itertools.count()

Tensors = list[torch.Tensor]


def _opts(kind: type, opts: Any, **defaults: Any) -> Any:
    """Accept torch's options object, a bare ReduceOp, or None."""
    if isinstance(opts, kind):
        return opts
    out = kind()
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        out.reduceOp = opts
    elif opts is not None:
        raise InvalidOptionError(f"expected {kind.__name__} or None, got {type(opts).__name__}")
    for k, v in defaults.items():
        setattr(out, k, v)
    return out


def _as_list(tensors: Any) -> Tensors:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


class ProcessGroup(dist.ProcessGroup):
    """A process group that can be aborted and rebuilt in place.

    Args:
        store: the rendezvous store (a ``TCPStore``, possibly behind a ``PrefixStore``).
            Groups that should later merge must share it.
        rank, world_size: this process's place in the initial configuration.
        backend: the inner communicator; ``"gloo"``.
        timeout: default timeout of every op and of a reconfigure rendezvous.
        enable_reconfigure: if False the group connects now, like ``ProcessGroupGloo``;
            if True it connects on the first :meth:`reconfigure`.
        flight_recorder: record every op in the process's flight recorder
            (None: yes unless ``FTC10D_FLIGHT_RECORDER=0``).
        check_collectives: before each collective, agree with every member on the op,
            shapes, dtypes, root and reduce op, so that a mismatch raises
            :class:`CollectiveMismatchError` on every rank instead of aborting the process
            inside Gloo. Costs one 16-byte all-reduce per collective (see
            ``ftc10d.pg.signature``). None: on if ``FTC10D_CHECK_COLLECTIVES=1`` or
            ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Every member must use the same setting.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: timedelta = DEFAULT_TIMEOUT,
        enable_reconfigure: bool = False,
        flight_recorder: Optional[bool] = None,
        check_collectives: Optional[bool] = None,
        _torch_files_it: bool = False,
    ) -> None:
        adapter = _backend.adapter(backend)  # InvalidOptionError naming the adapters
        why = adapter.unavailable()
        if why:
            raise InvalidOptionError(why)
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise InvalidOptionError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        if not enable_reconfigure and not 0 <= rank < world_size:
            raise InvalidOptionError(f"rank {rank} is not in [0, world_size={world_size})")
        super().__init__(rank, world_size)  # the (store, rank, size) overload has no Python trampoline
        self._store = store
        self._group_name = ""
        self._group_desc = ""
        self._init_rank = rank
        self._init_size = world_size
        self._backend_name = backend
        #: The communicator class of every generation of this group (``ftc10d.pg.backend``).
        self._adapter = adapter
        self._check_collectives = (
            _signature.enabled_from_env() if check_collectives is None else bool(check_collectives)
        )
        self._timeout = timeout
        self._timeout_ms = int(timeout.total_seconds() * 1000)
        self._handle = _handles.new_handle()
        self._gen: Optional[Generation] = None
        self._used_uuids: set[int] = set()
        self._reconfigure_lock = threading.Lock()
        #: The rendezvous a reconfigure() is waiting in, if any: abort() gives it up.
        self._pending: Optional[PendingRendezvous] = None
        # A second store connection, opened ahead of time, on which an abort gives a pending
        # rendezvous up while the first one waits in it (see PendingRendezvous).
        self._side = SideConnection(store)
        # uuids whose rendezvous was given up before it began (abandon_reconfigure); a uuid
        # is used once, so the entry is dropped when that rendezvous starts.
        self._given_up: dict[int, str] = {}
        self._op_ids = itertools.count()
        self._abort_hooks = HookRegistry("abort")
        self._pre_hooks = HookRegistry("pre")
        self._post_hooks = HookRegistry("post")
        self._group_id = next(_group_ids)
        self._on_reconfigure: list[Callable[["ProcessGroup"], None]] = []
        self._on_error: list[Callable[[CollectiveError], None]] = []
        #: Where a communication failure goes instead of being raised (swallow_errors).
        self._error_sink: Optional[Callable[[BaseException], None]] = None
        #: Sees every op at issue time (the flight recorder); see ftc10d.pg.observer.
        self._observer: Optional[OpObserver] = None
        from ftc10d.pg import c10d  # late: c10d imports this module

        if not _torch_files_it:  # else torch's new_group files it (ftc10d.pg.subgroups)
            c10d.register(self)
        if not enable_reconfigure:
            c10d.note_rank(rank)
            self._gen = bootstrap(
                store, self._handle, rank, world_size, c10d.global_rank(self), timeout, self._fire_abort_hooks,
                self._adapter,
            )
            self._gen.on_error = self._notify_error
            c10d.update_ranks(self)
        self._side.open_async()
        for fn in list(GROUP_CREATED):
            fn(self, flight_recorder)
        if self._observer is not None and self._gen is not None:
            self._observer.on_generation(self, self._gen)

    # ------------------------------------------------------------ identity

    def rank(self) -> int:
        gen = self._gen
        return gen.rank if gen is not None else self._init_rank

    def size(self) -> int:
        gen = self._gen
        return gen.size if gen is not None else self._init_size

    # torch's C++ callers (DDP's reducer, _verify_params_across_processes) ask
    # getRank()/getSize() through the trampoline: they must follow reconfigures too.
    def getRank(self) -> int:
        return self.rank()

    def getSize(self) -> int:
        return self.size()

    def getBackendName(self) -> str:
        return "ftc10d"

    # torch keeps a group's name on its backends, and ours has none registered:
    # these overrides (reached through torch's PyProcessGroup trampoline) keep it here.
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, group_name: str) -> None:
        self._group_name = group_name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, group_desc: str) -> None:
        self._group_desc = group_desc

    @property
    def adapter_name(self) -> str:
        """What carries this group's tensors: ``"gloo"``, or one adapter per device type
        (``"cpu:gloo,cuda:nccl"``, :mod:`ftc10d.pg.channels`). Sub-groups inherit it."""
        return self._backend_name

    def _get_backend_name(self) -> str:
        return "ftc10d"

    def name(self) -> str:
        return "ftc10d"

    def _get_backend(self, device: Any = None) -> Any:
        """The current configuration's backend for ``device`` (Gloo's, or a two-channel group's
        channel for it), for torch helpers that ask for capabilities (``supports_coalescing``...).
        Ops issued on it directly bypass ftc10d's hooks, sequence numbers and failure typing."""
        gen = self._gen
        if gen is None:
            raise NotConfiguredError("this ftc10d group has no configuration yet; call reconfigure() first")
        return gen.comm.channel_for_device(device).backend

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    @property
    def store(self) -> dist.Store:
        """The store this group's configurations meet in (the one it was created with)."""
        return self._store

    @property
    def uuid(self) -> Optional[int]:
        """uuid of the current configuration (None for the initial one or none yet)."""
        gen = self._gen
        return gen.uuid if gen is not None else None

    @property
    def reconfiguring(self) -> bool:
        """Whether a ``reconfigure()`` waits in its rendezvous now (``abort()`` gives it up)."""
        return self._pending is not None

    @property
    def generation(self) -> Optional[Generation]:
        return self._gen

    def __repr__(self) -> str:
        gen = self._gen
        state = "unconfigured" if gen is None else f"{gen.label}{', aborted' if gen.aborted else ''}"
        return f"ftc10d.ProcessGroup(rank={self.rank()}, size={self.size()}, {state})"

    # ----------------------------------------------------- reconfigure contract

    @property
    def supports_reconfigure(self) -> bool:
        return True

    def get_reconfigure_handle(self) -> str:
        return self._handle

    def reconfigure(self, opts: Any) -> dist.Work:
        """Abort the current configuration and connect the one ``opts`` describes.

        Synchronous: returns a completed work, or raises. Bad input raises before
        anything is aborted, so the group keeps its current configuration.
        """
        plan = _handles.plan_reconfigure(opts, self._handle, self._timeout)
        with self._reconfigure_lock:
            if plan.uuid in self._used_uuids:
                raise UuidReusedError(
                    f"uuid {plan.uuid} was already used by this group; every reconfigure needs a fresh uuid"
                )
            claim_uuid(self._store, plan)
            self._used_uuids.add(plan.uuid)
            from ftc10d.pg import c10d

            c10d.note_rank(plan.rank)
            old = self._gen
            if old is not None:
                old.abort(ErrorType.COMM_ERROR, f"reconfigured to generation {plan.uuid}")
                from ftc10d.pg import subgroups  # late: it imports this module

                subgroups.orphan_children(self, plan.uuid)
            # given up before it began (abandon_reconfigure): the waits below end at once
            self._side.open_async()  # normally open already (since __init__)
            self._pending = PendingRendezvous(self._store, plan, given_up=self._given_up.pop(plan.uuid, None),
                                              side=self._side)
            try:
                gen = rendezvous(self._store, plan, c10d.global_rank(self), self._timeout, self._fire_abort_hooks,
                                 self._adapter, self._pending)
            finally:
                self._pending = None
            gen.on_error = self._notify_error
            if self._observer is not None:
                self._observer.on_generation(self, gen)
            self._gen = gen
            if old is not None:
                old.retire()
            c10d.update_ranks(self)
        logger.info("reconfigured to %s: rank %d of %d", gen.label, gen.rank, gen.size)
        for fn in list(self._on_reconfigure):
            fn(self)
        return CompletedWork()

    def abort(self) -> None:
        """Abort the current configuration: every pending ``wait()`` raises
        :class:`ProcessGroupAborted`, and no op of it writes into a user tensor
        once this returns. ``reconfigure()`` makes the group usable again.

        A ``reconfigure()`` waiting in its rendezvous on another thread gives it up
        (:class:`ReconfigureAbandonedError`, here and on the other members) rather
        than wait for members that may never come."""
        pending = self._pending
        if pending is not None:
            pending.abandon(f"a member's group was aborted (pid {os.getpid()})")
        gen = self._gen
        if gen is not None:
            gen.abort(ErrorType.COMM_ERROR, "aborted by the user (ProcessGroup.abort())")

    def split_group(self, new_ranks: Sequence[int], timeout: Optional[timedelta] = None, opts: Any = None,
                    group_name: Optional[str] = None, group_desc: Optional[str] = None,
                    device_types: Any = None) -> Optional["ProcessGroup"]:
        """torch's ``ProcessGroup.split_group``: every member calls it with the same
        ``new_ranks`` (ranks of this group, in the new group's order); members get a new
        ftc10d group, the others None. It follows this group's configuration as a
        ``new_group`` does (see ``ftc10d.pg.subgroups``). ``opts``, ``group_name`` and
        ``device_types`` are accepted for torch's signature and not used."""
        from ftc10d.pg import subgroups  # late: it imports this module

        return subgroups.split(self, new_ranks, timeout, group_desc)

    def abandon_reconfigure(self, uuid: int, why: str = "") -> None:
        """Give up the rendezvous of configuration ``uuid``, whether it is pending now on
        another thread or starts later: ``reconfigure()`` to that uuid then raises
        :class:`ReconfigureAbandonedError` at once, here and on the other members.

        Why not ``abort()``: a membership that moves on while its member is about to apply
        the older configuration cannot know whether the rendezvous has begun yet. ``abort()``
        gives up only a rendezvous already pending, and one that begins a moment later waits
        its whole timeout for members that went straight to the newer configuration (chaos
        finding 16). A uuid is used once, so giving it up for good is never wrong."""
        uuid = _handles.check_uuid(uuid)
        why = why or f"a member gave configuration {uuid} up (pid {os.getpid()})"
        self._given_up[uuid] = why
        pending = self._pending  # read after the write above: reconfigure() does the converse
        if pending is not None and pending.plan.uuid == uuid:
            pending.abandon(why)

    def shutdown(self) -> None:
        """Tear the group down for good. Unlike abort() this is no failure: abort hooks do not fire."""
        pending = self._pending
        if pending is not None:
            pending.abandon(f"a member's group was shut down (pid {os.getpid()})")
        gen = self._gen
        if gen is not None and not gen.aborted:
            gen.abort(ErrorType.SUCCESS, "the group was shut down", hooks=False)
            gen.retire()
        self._side.drop()

    def get_error(self) -> Any:
        gen = self._gen
        if gen is not None and gen.aborted:
            return gen.error_type
        return ErrorType.SUCCESS

    def set_timeout(self, timeout: timedelta) -> None:
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise InvalidOptionError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        self._timeout = timeout
        self._timeout_ms = int(timeout.total_seconds() * 1000)
        gen = self._gen
        if gen is not None:
            gen.comm.set_timeout(timeout)

    # ------------------------------------------------------------ windows

    @property
    def supports_window(self) -> bool:
        return True

    def new_window(self, tensor: Optional[torch.Tensor] = None) -> Any:
        """Collectively create a one-sided (RMA) window of the current configuration
        (every rank, same order); ``tensor``, if given, is registered with it. See
        ``ftc10d.window``: the window dies with this configuration."""
        from ftc10d.window import new_window  # late: the window layer sits above pg/

        return new_window(self, tensor)

    # -------------------------------------------------------------- hooks

    def register_abort_hook(self, hook_id: int, hook: Callable[[], None]) -> None:
        self._abort_hooks.register(hook_id, hook)

    def unregister_abort_hook(self, hook_id: int) -> None:
        self._abort_hooks.unregister(hook_id)

    def register_pre_hook(self, hook_id: int, hook: Callable[[Any], None]) -> None:
        self._pre_hooks.register(hook_id, hook)

    def unregister_pre_hook(self, hook_id: int) -> None:
        self._pre_hooks.unregister(hook_id)

    def register_post_hook(self, hook_id: int, hook: Callable[[Any], None]) -> None:
        self._post_hooks.register(hook_id, hook)

    def unregister_post_hook(self, hook_id: int) -> None:
        self._post_hooks.unregister(hook_id)

    def _fire_abort_hooks(self) -> None:
        self._abort_hooks.fire_all()

    def add_reconfigure_listener(self, fn: Callable[["ProcessGroup"], None]) -> None:
        """Call ``fn(pg)`` after every successful reconfigure."""
        self._on_reconfigure.append(fn)

    def add_error_listener(self, fn: Callable[[CollectiveError], None]) -> None:
        """Call ``fn(error)`` with the first typed failure of each configuration, before it
        is aborted; ``error.peer`` names the failed member when known. This is how a
        failure detector (membership) learns of a dead peer from the data path. It may
        run on a backend thread: keep it short and non-blocking."""
        self._on_error.append(fn)

    def swallow_errors(self, report: Optional[Callable[[BaseException], None]]) -> None:
        """From now on, hand every communication failure of an op (issued on a failed or
        aborted configuration, or failing in ``wait()`` / its future) to ``report`` instead
        of raising it, and complete the op with its outputs as they are; ``None`` turns it
        off. Bad arguments still raise.

        For callers that must not be interrupted half-way, like FSDP2's forward and
        backward: they run to the end on meaningless values and the step is discarded by
        whoever got the report (FT-HSDP's shard group reports to the Manager, whose vote
        then does not commit). torchft's ``ErrorSwallowingProcessGroupWrapper`` does the
        same; here it is a mode of the group itself, so that the group object, its
        DeviceMesh and everything that holds it stay the same."""
        self._error_sink = report

    def _notify_error(self, err: CollectiveError) -> None:
        for fn in list(self._on_error):
            try:
                fn(err)
            except Exception:
                logger.exception("error listener %r raised; ignored", fn)

    # ------------------------------------------------------------ issue path

    def _issue(self, hook_name: Any, op: str, inputs: Tensors, outputs: Tensors, root: int, async_op: bool,
               call: Callable[[Any], Any], result: Any, p2p: bool = False, opts: Any = None,
               validate: Optional[Callable[[int], None]] = None) -> dist.Work:
        if _profiling.enabled():  # a profiler records: torch's events for this op (pg/profiling.py)
            shapes_of = outputs if op.startswith("recv") else inputs
            with _profiling.dispatcher_span(op), _profiling.op_span(self.getBackendName(), op, shapes_of) as span:
                work = self._issue_with_sink(hook_name, op, inputs, outputs, root, async_op, call, result, p2p,
                                             opts, validate)
                span.follow(work)
                return work
        return self._issue_with_sink(hook_name, op, inputs, outputs, root, async_op, call, result, p2p, opts,
                                     validate)

    def _issue_with_sink(self, hook_name: Any, op: str, inputs: Tensors, outputs: Tensors, root: int,
                         async_op: bool, call: Callable[[Any], Any], result: Any, p2p: bool, opts: Any,
                         validate: Optional[Callable[[int], None]]) -> dist.Work:
        sink = self._error_sink
        if sink is None:
            return self._issue_op(hook_name, op, inputs, outputs, root, async_op, call, result, p2p, opts, validate)
        try:
            work = self._issue_op(hook_name, op, inputs, outputs, root, async_op, call, result, p2p, opts, validate)
        except CollectiveError as exc:  # a failed or aborted configuration: no op was issued
            sink(exc)
            return CompletedWork(result)
        return SwallowedWork(work, sink, result)

    def _issue_op(
        self,
        hook_name: Any,
        op: str,
        inputs: Tensors,
        outputs: Tensors,
        root: int,
        async_op: bool,
        call: Callable[[Any], Any],
        result: Any,
        p2p: bool = False,
        opts: Any = None,
        validate: Optional[Callable[[int], None]] = None,
    ) -> Work:
        gen = self._gen
        if gen is None:
            raise NotConfiguredError(
                f"{op} on an ftc10d group that has no configuration yet: it was created with "
                "enable_reconfigure=True; call reconfigure() (or ftc10d.reconfigure(uuid, handles, group=pg)) first"
            )
        if gen.aborted:
            raise gen.aborted_error(op, gen.p2p_seq + 1 if p2p else gen.collective_seq + 1)
        if validate is not None:
            validate(gen.size)  # against the configuration the op is issued on
        op_id = next(self._op_ids)
        if self._pre_hooks.fns:
            self._pre_hooks.fire(make_pre_hook_args(hook_name, async_op, inputs, outputs, root, op_id))
        if p2p:
            gen.p2p_seq += 1
            seq = gen.p2p_seq
        else:
            gen.collective_seq += 1
            seq = gen.collective_seq
        obs = self._observer
        entry = obs.on_issue(self, gen, op, seq, p2p, root, inputs, outputs, op_id) if obs is not None else None
        if self._check_collectives and not p2p:
            self._check(gen, op, seq, root, opts, inputs, outputs, entry)
        comm = gen.comm.channel_for(inputs or outputs)  # itself, or a two-channel group's channel by device
        try:
            inner = call(comm.backend)
        except (TypeError, ValueError):
            if entry is not None:
                entry.fail("rejected arguments")
            raise  # bad arguments: the backend said so, nothing failed
        except Exception as exc:
            comm_failed = is_communication_failure(exc, gen.comm)
            if entry is not None:
                entry.fail("communication error" if comm_failed else "rejected arguments")
            if not comm_failed:
                # Gloo validates arguments with RuntimeError: bad input, the configuration is fine.
                raise InvalidOptionError(f"{op}: the backend rejected the arguments: {exc}") from exc
            raise gen.on_failure(op, seq, exc, abort_inline=True) from exc  # connection broken at issue time
        work = Work(gen, op, seq, inner, result, entry, comm)
        gen.track(inner, entry, work)
        if self._post_hooks.fns:
            self._post_hooks.fire(make_post_hook_args(hook_name, async_op, work, op_id))
        return work

    def _check(self, gen: Generation, op: str, seq: int, root: int, opts: Any, inputs: Tensors, outputs: Tensors,
               entry: Any) -> None:
        """The collective check (``check_collectives``): agree on the op's signature first."""
        sig = _signature.signature(op, root, opts, inputs, outputs)
        try:
            _signature.check(gen.backend, sig, op=op, seq=seq, uuid=gen.uuid, rank=gen.rank, size=gen.size)
        except CollectiveMismatchError:
            if entry is not None:
                entry.fail("collective mismatch")
            raise
        except Exception as exc:
            if not is_communication_failure(exc, gen.comm):
                raise
            if entry is not None:
                entry.fail("communication error")
            raise gen.on_failure(op, seq, exc, abort_inline=True) from exc

    @property
    def check_collectives(self) -> bool:
        """Whether each collective is checked against the other ranks' before it runs."""
        return self._check_collectives

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = _as_list(tensors)
        o = _opts(_c10d.AllreduceOptions, opts)
        return self._issue(HookOpName.ALLREDUCE, "all_reduce", tensors, tensors, -1, o.asyncOp,
                           lambda b: b.allreduce(tensors, o), tensors, opts=o)

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllreduceCoalescedOptions, opts)
        return self._issue(HookOpName.ALLREDUCE, "all_reduce_coalesced", tensors, tensors, -1, o.asyncOp,
                           lambda b: b.allreduce_coalesced(tensors, o), tensors, opts=o)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = _as_list(tensors)
        o = _opts(_c10d.BroadcastOptions, opts)
        return self._issue(HookOpName.BROADCAST, "broadcast", tensors, tensors, o.rootRank, o.asyncOp,
                           lambda b: b.broadcast(tensors, o), tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = _as_list(tensors)
        o = _opts(_c10d.ReduceOptions, opts)
        return self._issue(HookOpName.REDUCE, "reduce", tensors, tensors, o.rootRank, o.asyncOp,
                           lambda b: b.reduce(tensors, o), tensors, opts=o)

    def allgather(self, output_tensors: list[Tensors], input_tensors: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllgatherOptions, opts)
        flat_out = [t for ts in output_tensors for t in ts]
        return self._issue(HookOpName.ALLGATHER, "all_gather", input_tensors, flat_out, -1, o.asyncOp,
                           lambda b: b.allgather(output_tensors, input_tensors, o), output_tensors)

    def allgather_coalesced(self, output_lists: list[Tensors], input_list: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllgatherOptions, opts)
        flat_out = [t for ts in output_lists for t in ts]
        return self._issue(HookOpName.ALLGATHER, "all_gather_coalesced", input_list, flat_out, -1, o.asyncOp,
                           lambda b: b.allgather_coalesced(output_lists, input_list, o), output_lists)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllgatherOptions, opts)
        return self._issue(HookOpName.ALLGATHER, "all_gather_into_tensor", [input], [output], -1, o.asyncOp,
                           lambda b: b._allgather_base(output, input, o), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllgatherOptions, opts)
        return MultiWork([self.all_gather_single(out, inp, o) for out, inp in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[Tensors], input_tensors: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.GatherOptions, opts)
        flat_out = [t for ts in output_tensors for t in ts]
        return self._issue(HookOpName.GATHER, "gather", input_tensors, flat_out, o.rootRank, o.asyncOp,
                           lambda b: b.gather(output_tensors, input_tensors, o), output_tensors)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.GatherOptions, opts)
        outs = [list(output.chunk(self.size(), 0))] if self.rank() == o.rootRank else []
        return self._issue(HookOpName.GATHER, "gather_into_tensor", [input], [output], o.rootRank, o.asyncOp,
                           lambda b: b.gather(outs, [input], o), [output])

    def scatter(self, output_tensors: Tensors, input_tensors: list[Tensors], opts: Any = None) -> dist.Work:
        o = _opts(_c10d.ScatterOptions, opts)
        flat_in = [t for ts in input_tensors for t in ts]
        return self._issue(HookOpName.SCATTER, "scatter", flat_in, output_tensors, o.rootRank, o.asyncOp,
                           lambda b: b.scatter(output_tensors, input_tensors, o), output_tensors)

    def reduce_scatter(self, output_tensors: Tensors, input_tensors: list[Tensors], opts: Any = None) -> dist.Work:
        o = _opts(_c10d.ReduceScatterOptions, opts)
        flat_in = [t for ts in input_tensors for t in ts]
        return self._issue(HookOpName.REDUCE_SCATTER, "reduce_scatter", flat_in, output_tensors, -1, o.asyncOp,
                           lambda b: b.reduce_scatter(output_tensors, input_tensors, o), output_tensors,
                           opts=o)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.ReduceScatterOptions, opts)
        return self._issue(HookOpName.REDUCE_SCATTER, "reduce_scatter_tensor", [input], [output], -1, o.asyncOp,
                           lambda b: b._reduce_scatter_base(output, input, o), [output], opts=o)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.ReduceScatterOptions, opts)
        return MultiWork([self.reduce_scatter_single(out, inp, o) for out, inp in zip(outputs, inputs)], outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors: Tensors, input_tensors: Tensors, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.AllToAllOptions, opts)
        return self._issue(HookOpName.ALLTOALL, "all_to_all", input_tensors, output_tensors, -1, o.asyncOp,
                           lambda b: b.alltoall(output_tensors, input_tensors, o), output_tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> dist.Work:
        """Split sizes that cannot fit the tensors raise :class:`InvalidOptionError` here, on
        this rank, as NCCL's do (Gloo would check them on its own thread and fail the op at
        ``wait()``, which reads as a broken configuration and aborts it). The op is then not
        issued: if the other ranks issued theirs, they wait for it until the timeout, so a
        rank that catches this error should ``abort()`` the group (or all ranks should
        compute their sizes alike). Sizes that fit locally but disagree across ranks are
        still Gloo's to find."""
        o = _opts(_c10d.AllToAllOptions, opts)
        outs, ins = list(output_split_sizes), list(input_split_sizes)

        def validate(size: int) -> None:
            _check_split_sizes("output", output, outs, size)
            _check_split_sizes("input", input, ins, size)
            if not outs and not ins and output.numel() != input.numel():
                raise InvalidOptionError(
                    f"all_to_all_single without split sizes needs input and output of one size; got "
                    f"{input.numel()} and {output.numel()} elements")

        return self._issue(HookOpName.ALLTOALL, "all_to_all_single", [input], [output], -1, o.asyncOp,
                           lambda b: b.alltoall_base(output, input, outs, ins, o), [output], validate=validate)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> dist.Work:
        o = _opts(_c10d.BarrierOptions, opts)
        return self._issue(HookOpName.BARRIER, "barrier", [], [], -1, o.asyncOp, lambda b: b.barrier(o), [])

    def monitored_barrier(self, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False) -> None:
        """torch's ``monitored_barrier`` on the current configuration: Gloo's own (rank 0 waits
        for every rank within ``timeout`` and raises ``RuntimeError`` naming the ranks that did
        not arrive; the others wait for rank 0), run on this configuration's Gloo backend, so
        that its messages are torch's word for word. Blocking and synchronous like torch's; not
        hooked or recorded (torch's is no dispatcher op either); an abort ends it by cutting the
        connections it waits on. ``dist.monitored_barrier(group=pg)`` lands here
        (:mod:`ftc10d.pg.debug`)."""
        gen = self._gen
        if gen is None:
            raise NotConfiguredError("this ftc10d group has no configuration yet; call reconfigure() first")
        if gen.aborted:
            raise gen.aborted_error("monitored_barrier", gen.collective_seq + 1)
        inner = getattr(gen.backend, "monitored_barrier", None)
        if inner is None or not isinstance(gen.backend, dist.ProcessGroupGloo):
            raise InvalidOptionError("monitored_barrier is only implemented for Gloo (as in torch); this group's "
                                     f"configurations run on {type(gen.backend).__name__}")
        inner(timeout if timeout is not None else self._timeout, wait_all_ranks)

    # ---------------------------------------------------------------- p2p

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> dist.Work:
        tensors = _as_list(tensors)
        self._check_peer(dstRank, "send")
        return self._issue(HookOpName.SEND, "send", tensors, [], dstRank, True,
                           lambda b: b.send(tensors, dstRank, tag), tensors, p2p=True)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> dist.Work:
        tensors = _as_list(tensors)
        self._check_peer(srcRank, "recv")
        return self._issue(HookOpName.RECV, "recv", [], tensors, srcRank, True,
                           lambda b: b.recv(tensors, srcRank, tag), tensors, p2p=True)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        tensors = _as_list(tensors)
        return self._issue(HookOpName.RECV, "recv_anysource", [], tensors, -1, True,
                           lambda b: b.recv_anysource(tensors, tag), tensors, p2p=True)

    def _check_peer(self, peer: int, op: str) -> None:
        size = self.size()
        if not 0 <= peer < size:
            raise InvalidOptionError(f"{op}: peer rank {peer} is not in [0, {size}) of the current configuration")
        if peer == self.rank():
            raise InvalidOptionError(f"{op}: peer rank {peer} is this process's own rank")


def _check_split_sizes(which: str, tensor: torch.Tensor, sizes: list[int], size: int) -> None:
    if tensor.dim() == 0:
        raise InvalidOptionError(f"all_to_all_single: the {which} tensor is 0-dimensional; it is split along dim 0")
    rows = tensor.size(0)
    if not sizes:
        if rows % size:
            raise InvalidOptionError(
                f"all_to_all_single: the {which} tensor's dim 0 ({rows}) does not divide equally across the "
                f"{size} ranks of the current configuration; pass {which}_split_sizes")
        return
    if len(sizes) != size:
        raise InvalidOptionError(
            f"all_to_all_single: {which}_split_sizes has {len(sizes)} entries, the current configuration has "
            f"{size} ranks; give one size per rank")
    if any(n < 0 for n in sizes):
        raise InvalidOptionError(f"all_to_all_single: {which}_split_sizes must not be negative, got {sizes}")
    if sum(sizes) != rows:
        raise InvalidOptionError(
            f"all_to_all_single: {which}_split_sizes {sizes} add up to {sum(sizes)}, the {which} tensor's dim 0 "
            f"is {rows}")

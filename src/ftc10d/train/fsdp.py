"""FT-HSDP's groups and state: FSDP2 inside each replica, a fault-tolerant replicate axis.

One rank owns two ftc10d groups, each created once and reconfigured in place at every
configuration change of the job (:class:`HSDPGroups`):

- the **shard group**: its replica's ``S`` ranks, ordered by shard index, so that the
  rank in it *is* the shard index whatever configuration it is in. FSDP2 shards over a
  1-D mesh of it (``DeviceMesh.from_group``), made once: since the group object stays
  and its rank stays, the module FSDP2 sharded keeps working across reconfigures
  (``tests/train/test_fsdp_seam.py``), and a replica's survivors keep their modules
  while a replacement takes the dead rank's place.
- the **replicate group**: the ranks of the same shard index in the replicas that train
  (complete ones). The cross-replica all-reduce runs in FSDP2's ``set_all_reduce_hook``
  on it and divides by its current size: gradients are averaged over the replicas taking
  part in the step, never by a stale replicate size.

Their stores live under the job store at fixed prefixes (``ftc10d/hsdp/shard/<replica>``,
``ftc10d/hsdp/replicate/<shard index>``), and a configuration's handles under
``ftc10d/hsdp/<uuid>/<slot>``: the world configuration's uuid is the sub-groups'
uuid too (unique per configuration; each group has its own store, so it is used once
per group).

What a replacement receives is the rank's *local* state: the local shards of the
parameters and of the optimizer's per-parameter state (:func:`local_state`,
:func:`load_local_state`), sent by a live rank of the same shard index
(:func:`ftc10d.train.recovery.shard_plans`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ftc10d.pg import ProcessGroup
from ftc10d.train.mesh import HSDPLayout, Placement
from ftc10d.types import (
    InvalidOptionError,
    MembershipTimeoutError,
    NotConfiguredError,
    ProcessGroupAborted,
    ReconfigureTimeoutError,
    StateLostError,
)

logger = logging.getLogger("ftc10d")

PREFIX = "ftc10d/hsdp"
#: How often configure()'s wait for the others' handles looks whether the configuration was aborted.
_SLICE = timedelta(milliseconds=100)


def _coordinate(mesh: Any) -> Optional[int]:
    """This process's coordinate in a 1-D mesh (None if torch does not place it in it)."""
    coord = mesh.get_coordinate()
    return None if coord is None else int(list(coord)[0])


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class HSDPGroups:
    """This rank's shard and replicate groups (module docstring).

    Args:
        store: the job's store (every rank's, the same).
        layout: the mesh at full strength.
        slot: this rank's slot (its coordinates, :mod:`ftc10d.train.mesh`).
        timeout: the groups' op and rendezvous timeout.
    """

    def __init__(self, store: dist.Store, layout: HSDPLayout, slot: int,
                 timeout: timedelta = timedelta(minutes=5), backend: Optional[str] = None) -> None:
        from ftc10d.pg.channels import control_backend, default_backend, mesh_device

        backend = backend if backend is not None else default_backend()
        #: The device type of the shard group's DeviceMesh: the data channel's, where it runs.
        self.device_type = mesh_device(backend)
        self.layout = layout
        self.slot = slot
        self.replica, self.shard_index = layout.coords(slot)
        self._store = store
        self.shard = ProcessGroup(dist.PrefixStore(f"{PREFIX}/shard/{self.replica}", store), 0, layout.shard_size,
                                  timeout=timeout, enable_reconfigure=True, backend=backend)
        self.replicate = ProcessGroup(dist.PrefixStore(f"{PREFIX}/replicate/{self.shard_index}", store), 0,
                                      layout.replicas, timeout=timeout, enable_reconfigure=True, backend=backend)
        #: Every rank that trains, by (replica, shard index): the Manager's vote runs on it (a
        #: control message: on the CPU channel's adapter alone).
        self.participants = ProcessGroup(dist.PrefixStore(f"{PREFIX}/participants", store), 0, layout.world_size,
                                         timeout=timeout, enable_reconfigure=True, backend=control_backend(backend))
        self.uuid: Optional[int] = None
        #: The configuration configure() is moving the groups to, while it does.
        self._moving: Optional[int] = None
        #: The placement of the configuration the groups were last moved to.
        self.placement: Optional[Placement] = None
        self._mesh: Any = None

    @property
    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` of the shard group, for ``fully_shard(..., mesh=)`` (made once,
        at the first configuration this rank trains in)."""
        if self._mesh is None:
            if self.shard.generation is None:
                raise NotConfiguredError("the shard group has no configuration yet: call configure() first, "
                                         "from a configuration in which this rank's replica is complete")
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self.shard, self.device_type)
            if _coordinate(mesh) != self.shard_index:
                # torch places this process in the mesh by its rank in the default (world) group, which
                # follows membership order, while the shard group's "global" ranks are the stable slots:
                # place it by its slot (FSDP2 reads the coordinate once, when it shards the module).
                mesh._rank = dist.get_process_group_ranks(self.shard)[self.shard_index]
                mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
                if _coordinate(mesh) != self.shard_index:
                    raise RuntimeError(f"ftc10d could not place slot {self.slot} in its shard group's DeviceMesh "
                                       f"(coordinate {mesh.get_coordinate()}, expected [{self.shard_index}])")
            self._mesh = mesh
        return self._mesh

    def configure(self, placement: Placement, uuid: int, world_rank: int, world: Optional[ProcessGroup] = None) -> bool:
        """Move both groups to the configuration ``uuid`` (the world group's) described by
        ``placement``; every rank of the configuration calls it. Returns whether this rank
        trains in it (its replica is complete): one that does not touches neither group and
        waits for the next configuration, keeping its shard. With ``world`` (the world group),
        waiting for the others' handles ends with :class:`ProcessGroupAborted` as soon as the
        world's configuration is aborted (a member left or died meanwhile: the membership
        aborts it), instead of waiting out the timeout for handles that will never come."""
        from ftc10d.pg.c10d import reconfigure

        key = f"{PREFIX}/{uuid}"
        if placement.coords(world_rank) is None:
            return False  # surplus: another rank holds this slot (and publishes under it)
        if not placement.trains(world_rank):
            self.abort()  # its configurations hold a dead peer: nothing may wait in them
            return False
        if self.uuid == uuid:
            return True  # moved there already (device_mesh() and the first step's recovery)
        groups = (self.shard, self.replicate, self.participants)
        self._store.set(f"{key}/{self.slot}", " ".join(g.get_reconfigure_handle() for g in groups))
        slots = placement.slots
        mates = [slots[r] for r in placement.replica_ranks(self.replica) if r is not None]
        peers = [slots[r] for r in placement.shard_ranks(self.shard_index, complete_only=True)]
        everyone = [slots[r] for r in placement.participants]
        self._wait([f"{key}/{s}" for s in everyone], uuid, world)
        handles = dict(zip(everyone, (v.decode().split(" ") for v in self._store.multi_get(
            [f"{key}/{s}" for s in everyone]))))
        self._moving = uuid  # abort() gives these rendezvous up, also one not begun yet
        try:
            for group, members in ((self.shard, mates), (self.replicate, peers), (self.participants, everyone)):
                self._check_world(world, uuid)  # aborted between two of them: a peer left, it will not come
                column = 0 if group is self.shard else 1 if group is self.replicate else 2
                reconfigure(uuid, [handles[s][column] for s in members], group=group)
        finally:
            self._moving = None
        self.uuid, self.placement = uuid, placement
        return True

    @staticmethod
    def _check_world(world: Optional[ProcessGroup], uuid: int) -> None:
        gen = world.generation if world is not None else None
        if gen is not None and (gen.aborted or gen.uuid != uuid):
            raise ProcessGroupAborted(
                f"FT-HSDP: configuration {uuid} was aborted while its ranks moved their sub-groups "
                "(a member left or died meanwhile, or a newer configuration came)", op="hsdp_configure", uuid=uuid)

    def _wait(self, keys: list[str], uuid: int, world: Optional[ProcessGroup]) -> None:
        """The store wait of :meth:`configure`, in slices: given up when ``world`` is aborted."""
        deadline = time.monotonic() + self.shard.timeout.total_seconds()
        while True:
            try:
                self._store.wait(keys, _SLICE)
                return
            except (RuntimeError, dist.DistError):  # the slice's timeout (DistStoreError)
                self._check_world(world, uuid)
                if time.monotonic() > deadline:
                    raise ReconfigureTimeoutError(
                        f"FT-HSDP: the ranks of configuration {uuid} did not all publish their sub-group handles "
                        f"within {self.shard.timeout}; some rank is stuck before its recovery") from None

    def failed(self) -> bool:
        """Whether one of the groups' current configurations failed or was aborted."""
        from ftc10d.types import ErrorType

        return any(g.generation is not None and (g.generation.aborted or g.get_error() != ErrorType.SUCCESS)
                   for g in (self.shard, self.replicate, self.participants))

    def all_reduce_hook(self, on_failure: Callable[[BaseException], None]) -> Callable[[torch.Tensor], None]:
        """FSDP2's all-reduce hook: average the reduce-scattered gradient over the replicas
        that train. A failure is handed to ``on_failure`` (the step must not commit) and the
        gradient left as it is: the hook never raises into FSDP2's backward."""

        def hook(grad: torch.Tensor) -> None:
            replicas = self.replicate.size()  # of the configuration the all-reduce is issued on
            try:
                self.replicate.allreduce([grad]).wait()
            except Exception as exc:  # noqa: BLE001 - any failure fails the step, see on_failure
                on_failure(exc)
                return
            grad.div_(replicas)

        return hook

    def abort(self) -> None:
        """Abort the groups' current configurations (their pending ops raise at once), and
        give up a rendezvous one of them waits in: :meth:`configure` moves them one after
        the other, and a peer that left the world's configuration half-way (aborted before
        its own ``configure``) never comes to it; without this, the rank waits out the
        groups' timeout there. A rendezvous of the move under way that has not begun yet is
        given up too (``abandon_reconfigure``): it would wait for the same peer."""
        moving = self._moving
        for pg in (self.shard, self.replicate, self.participants):
            if moving is not None:
                pg.abandon_reconfigure(moving, "FT-HSDP: the world's configuration was aborted")
            gen = pg.generation
            if pg.reconfiguring or (gen is not None and not gen.aborted):
                pg.abort()


# ------------------------------------------------------------ local state


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name: what ``state_dict()`` holds, read
    from the modules themselves. Not ``state_dict()``: a model's state-dict hooks may convert
    (torchtitan's llama3 splits its fused ``wqkv`` into full ``wq``/``wk``/``wv``, gathering the
    shards over the shard group): that would not be this rank's local shard, and on a replica
    whose shard group lost a peer it would read garbage."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def local_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """This rank's share of the model and optimizer: every parameter's and buffer's local
    shard, the optimizer's per-parameter state (its tensors' local shards) by parameter
    name, and its param groups' hyperparameters (lr, momentum...: a scheduler changes
    them; register the scheduler's own state too). Ranks of the same shard index hold
    equal ones (invariant 1 per shard)."""
    out: dict[str, Any] = {"model": {k: _local(v) for k, v in _model_tensors(model).items()}}
    if optimizer is not None:
        names = {p: n for n, p in model.named_parameters()}
        out["optim"] = {names[p]: {k: (_local(v) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                        for p, st in optimizer.state.items() if p in names}
        out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out


def load_local_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Copy a :func:`local_state` of the same shard index into this rank's model and
    optimizer, in place (FSDP2's parameters stay the same objects)."""
    own = _model_tensors(model)
    if set(own) != set(state["model"]):
        raise InvalidOptionError(f"received model state names {sorted(state['model'])} differ from this model's "
                                 f"{sorted(own)}: the same model on every rank?")
    with torch.no_grad():
        for k, v in state["model"].items():
            _local(own[k]).copy_(v)
    if optimizer is None:
        return
    params = dict(model.named_parameters())
    unknown = sorted(set(state.get("optim", {})) - set(params))
    groups = state.get("param_groups", [])
    if unknown or (groups and len(groups) != len(optimizer.param_groups)):
        raise InvalidOptionError(f"received optimizer state for parameters {unknown} this model lacks, or "
                                 f"{len(groups)} param groups for {len(optimizer.param_groups)}: the same model and "
                                 "optimizer on every rank?")
    for mine_group, got in zip(optimizer.param_groups, groups):
        mine_group.update(got)
    for name in set(params) - set(state.get("optim", {})):
        optimizer.state.pop(params[name], None)  # the source had none: neither may this rank
    for name, st in state.get("optim", {}).items():
        p = params[name]
        mine = optimizer.state.get(p)
        if not mine:  # this rank has not stepped yet: take the received tensors, shaped as its params
            optimizer.state[p] = {k: (_wrap_like(p, v) if isinstance(v, torch.Tensor) and v.dim() else v)
                                  for k, v in st.items()}
            continue
        for k, v in st.items():
            if isinstance(mine.get(k), torch.Tensor):
                with torch.no_grad():
                    _local(mine[k]).copy_(v)
            else:
                mine[k] = v


def _wrap_like(param: Any, local: torch.Tensor) -> Any:
    """``local`` as a tensor of ``param``'s kind (a DTensor with its mesh and placements)."""
    from_local = getattr(type(param), "from_local", None)
    if from_local is None:
        return local.clone()
    return from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                      shape=param.shape, stride=param.stride())


# ------------------------------------------------------------ driven by the Manager

def recover_shards(manager: Any, cfg: Any, deadline: float) -> bool:
    """The FT-HSDP part of ``Manager._recover``, on every rank of configuration ``cfg``:
    place the ranks, bring every shard index to the job's state (:func:`shard_plans`),
    move the shard and replicate groups, compare each shard index's replicas. Returns
    False when this rank's replica is incomplete: it then waited for the next
    configuration (keeping its shard) and the caller starts over."""
    from ftc10d.train.consistency import exchange_identities
    from ftc10d.train.progress import JobProgress
    from ftc10d.train.recovery import exchange, exchange_info, shard_plans, transfer

    groups: HSDPGroups = manager.hsdp
    pg = manager.pg
    ready = manager.registered_fsdp
    rows, job = exchange(pg, manager.step, manager._synced, manager.commit_epoch, groups.slot, ready,
                         JobProgress.read(manager.member))
    placement = groups.layout.placement([r[3] for r in rows])
    if _one_step_behind(placement, rows):
        manager._roll_forward_to(*_target(placement, rows))
        rows = exchange_info(pg, manager.step, manager._synced, manager.commit_epoch, groups.slot, ready)
    # the job may go on only from its newest committed state (train/progress.py), per shard below
    held = [(r[2], r[0]) if r[1] and placement.coords(i) is not None else None for i, r in enumerate(rows)]
    if not manager._continues(cfg, job, max((h for h in held if h is not None), default=None), held, 0, deadline):
        return False
    try:
        plans = shard_plans(placement, rows)
    except StateLostError as lost:  # no live rank here holds some shard: wait for one to come back
        _wait_for_holder(manager, cfg, lost, deadline)
        return False
    trains = groups.configure(placement, pg.uuid, pg.rank(), pg)
    plan = plans.get(groups.shard_index) if placement.coords(pg.rank()) is not None else None
    if plan is not None:
        own = manager.state_dict if manager._synced and ready else None
        state, nbytes, secs = transfer(pg, plan, manager.state_dict, own)
        manager._received(plan, state, nbytes, secs)
    # each shard index's replicas compared; a rank that has not registered its model yet (a
    # replacement before Manager.fsdp: what it received waits there) is left out
    ids = exchange_identities(pg, manager._fingerprint48() if ready else 0, manager.step, manager.commit_epoch)
    keep = [r for r, row in enumerate(rows) if row[4] and placement.coords(r) is not None]
    if keep:
        manager._compare([ids[r] for r in keep], "after the configuration change",
                         [placement.coords(r)[1] for r in keep], keep)  # type: ignore[index]
    if not trains:
        manager._emit("waiting", epoch=cfg.epoch, replica=groups.replica, complete=list(placement.complete))
        logger.info("manager: replica %d is incomplete in epoch %d; waiting for its replacement", groups.replica,
                    cfg.epoch)
        manager.member.wait_next(cfg.epoch, timeout=max(deadline - time.monotonic(), 0.001))
        return False
    return True


def _wait_for_holder(manager: Any, cfg: Any, lost: StateLostError, deadline: float) -> None:
    """No rank of configuration ``cfg`` holds some shard at the job's state. Its holders were
    removed, but one removed on suspicion (frozen, starved past the heartbeat timeout, cut
    off) is not dead: it finds itself fenced when it runs again and rejoins with its shard,
    the same committed state (``Manager._on_fenced``). Training on without it would start a
    second history, so every rank (all compute the same plans) waits for the next
    configuration, then plans again; after ``sync_timeout`` the shard is lost: StateLostError.
    The same rule as for the job's state as a whole (:func:`ftc10d.train.progress.wait_for_holder`)."""
    logger.error("manager: %s; waiting up to %.0f s for a rank holding it to come back", lost,
                 max(deadline - time.monotonic(), 0.0))
    manager._emit("state_lost", epoch=cfg.epoch, error=str(lost))
    try:
        manager.member.wait_next(cfg.epoch, timeout=max(deadline - time.monotonic(), 0.001))
    except MembershipTimeoutError:
        raise StateLostError(f"{lost}. No rank holding it came back within the Manager's sync_timeout "
                             f"({manager.sync_timeout:g} s)") from None


def _target(placement: Placement, rows: list[tuple[int, bool, int, int, bool]]) -> tuple[int, int]:
    """The job's state here: the greatest ``(commit epoch, step)`` of a synchronized, placed rank."""
    return max((r[2], r[0]) for i, r in enumerate(rows) if r[1] and placement.coords(i) is not None)


def _one_step_behind(placement: Placement, rows: list[tuple[int, bool, int, int, bool]]) -> bool:
    """Whether some synchronized rank is one step behind the job's state: it may hold that
    step's reduced gradients and roll forward (``Manager._roll_forward_to``). Every rank
    computes the same answer from the same rows, so all or none exchange again."""
    placed = [r for i, r in enumerate(rows) if r[1] and placement.coords(i) is not None]
    if not placed:
        return False
    step = _target(placement, rows)[1]
    return any(r[0] == step - 1 for r in placed)


class FSDPSettings:
    """FSDP2's per-module communication settings (reshard after forward/backward, gradient
    sync), captured once and restored at the start of every step.

    Why: code that toggles them inside a step and leaves them changed makes a process's
    collectives depend on how many steps *it* has run. torchtitan's chunked loss sets
    ``reshard_after_forward(True)`` on ``[norm, lm_head]`` at the end of each step (torchtitan
    configured False): a veteran then all-gathers that unit twice per forward, a replacement
    in its first step once, and their shard group hangs on mismatched collectives. Restored
    to the settings of step 1 before every step, every rank of a replica issues the same
    collectives whatever its history (what FT-HSDP's replacements need)."""

    _FIELDS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads")

    def __init__(self, model: torch.nn.Module) -> None:
        self._saved: list[tuple[Any, Any, dict[str, Any]]] = []
        for m in model.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            for group in getattr(state, "_fsdp_param_groups", []):
                self._saved.append((state, group, {f: getattr(group, f) for f in self._FIELDS if hasattr(group, f)}))

    def restore(self) -> None:
        for state, group, fields in self._saved:
            for name, value in fields.items():
                setattr(group, name, value)

"""torchtitan's ``Trainer`` on FT-HSDP: a rank or a whole replica lost, the others train on.

``FaultTolerantTrainer`` is torchtitan's trainer with four seams moved onto ftc10d
(``--module ftc10d.integrations.torchtitan``, :mod:`.config_registry`):

- **groups** (``init_distributed``): the worker joins the job's membership
  (``ftc10d.train.init_from_env``, under ``ftc10d launch``) and the Manager's FT-HSDP groups;
  torchtitan's meshes are the replica's shard group (:mod:`.parallel_dims`), FSDP2's
  cross-replica all-reduce is ftc10d's replicate group (``Manager.fsdp``).
- **the step** (``train``): ``zero_grad`` starts a step (a new configuration: reconfigure,
  live recovery of a replacement's shards), the forward/backward and the gradient clipping
  run inside ``manager.collectives()`` (a dead peer fails the step, not the process), and the
  optimizer and the LR scheduler are applied only if the commit vote says every complete
  replica finished the step. torchtitan's metrics are logged for committed steps only (a
  discarded step's loss means nothing, so its ``isfinite`` check sees only those).
- **data**: the loader reads part ``replica * shard_size + shard`` of ``replicas x shard_size``,
  and batch ``k`` of that part is what committed step ``k + 1`` trains on, whatever happened:
  a failed step is redone on the same batch; a replacement (which receives the committed
  step count with its shards) or a replica that waited out others' steps skips to the batch
  of the next step (the data of steps its replica missed is skipped, never trained twice).
- **state**: a replacement receives from a live rank of the same shard index its model and
  optimizer shards, the LR scheduler and the step (ftc10d's live recovery, not a checkpoint).
  torchtitan's checkpoints (``--checkpoint.enable``) are written by one complete replica
  (:mod:`.checkpoint`).

Every rank also writes its steps and ftc10d's events (pause, recoveries, members) to
``--ftc10d.events DIR`` (JSON lines, one file per slot) when given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torchtitan.trainer import Trainer

from ftc10d.types import InvalidOptionError, JobFinished

logger = logging.getLogger("ftc10d")


@dataclass(kw_only=True, slots=True)
class FaultToleranceConfig:
    """``--ftc10d.*``: FT-HSDP's shape and the Manager's settings."""

    replicas: int = 1
    """Replicas (R); each has WORLD_SIZE / R ranks sharding the model with FSDP2."""
    sync_timeout: float = 300.0
    """Seconds a recovery waits for a holder of the job's newest state before StateLostError."""
    check_every: int = 100
    """Compare the replicas' state fingerprints every this many steps (0: at configuration changes only)."""
    fingerprint_every: int = 0
    """Write this rank's shard fingerprint to the events every this many committed steps (0: never)."""
    events: str = ""
    """A directory: each slot writes its steps and ftc10d's events there as JSON lines."""


class _Events:
    """One slot's JSON-lines event file (``--ftc10d.events``), or nothing."""

    def __init__(self, folder: str, name: str, **context: Any) -> None:
        self._f = None
        self._context = context
        if folder:
            os.makedirs(folder, exist_ok=True)
            self._f = open(os.path.join(folder, f"{name}.jsonl"), "a", buffering=1)

    def emit(self, kind: str, **info: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"kind": kind, "t": time.time(), **self._context, **info}, default=str) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class StepBatches:
    """Batch ``k`` of this rank's part of the data for committed step ``k + 1`` (module docstring)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self.position = 0  # batches drawn
        self._last: Optional[tuple[int, Any]] = None

    def for_step(self, k: int) -> Any:
        if self._last is not None and self._last[0] == k:
            return self._last[1]  # the step failed: the same batch again
        if k < self.position:
            raise InvalidOptionError(f"batch {k} was drawn already (the data loader is at {self.position}): the "
                                     "Manager's step went back, which only a rollback does; restart from a checkpoint")
        while self.position < k:  # steps this rank's replica did not train: their data is skipped
            next(self._batches)
            self.position += 1
        batch = next(self._batches)
        self.position += 1
        self._last = (k, batch)
        return batch


@contextlib.contextmanager
def _received_parameters(joining: Callable[[], bool]) -> Iterator[None]:
    """On a replacement, torchtitan's parameter initialisation only zeroes the local shards.

    Its parameters are overwritten by the state it received (``Manager.fsdp``), and initialising
    them as torchtitan does would run collectives on the shard group while the replica's live
    ranks are training: on torch 2.15, ``trunc_normal_`` on a sharded DTensor redistributes (an
    all-gather of its mask) and the replacement waited there forever. Buffers (the RoPE cache)
    are still computed as torchtitan does: they are not part of the state.
    """
    from torchtitan.protocols.module import Module

    from ftc10d.train.fsdp import _local

    original = Module._init_self_parameters

    def init_self_parameters(module: Any) -> None:
        if not joining():  # the job's start, or a restart from a checkpoint: torchtitan's init
            original(module)
            return
        with torch.no_grad():
            for _, param in module.named_parameters(recurse=False):
                _local(param).zero_()

    Module._init_self_parameters = init_self_parameters
    try:
        yield
    finally:
        Module._init_self_parameters = original


class FaultTolerantTrainer(Trainer):
    """torchtitan's trainer with ftc10d's FT-HSDP (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        ftc10d: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    # ------------------------------------------------------------ setup

    def init_distributed(self) -> Any:
        from ftc10d.integrations.torchtitan.parallel_dims import FTParallelDims
        from ftc10d.train import Manager, init_from_env
        from ftc10d.train.fsdp import HSDPGroups
        from ftc10d.train.mesh import HSDPLayout

        ft = self.config.ftc10d
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if "FTC10D_COORDINATOR" not in os.environ:
            raise InvalidOptionError("ftc10d's torchtitan trainer runs under `ftc10d launch` (it joins the job's "
                                     "membership): ftc10d launch --nproc-per-node N "
                                     "$(python -m ftc10d.integrations.torchtitan --script) --module ...")
        if ft.replicas < 1 or world % ft.replicas:
            raise InvalidOptionError(f"--ftc10d.replicas {ft.replicas} does not divide the job's {world} workers: "
                                     "start replicas x shard_size workers")
        if self.config.debug.seed is None:
            # torchtitan would broadcast a random seed over the world: a replacement started later
            # would wait in that broadcast alone. Every rank needs the same initial model anyway.
            self.config.debug.seed = 0
            logger.info("ftc10d: --debug.seed not given: 0 (every rank needs the same initial model)")
        slot = int(os.environ["RANK"])
        pg, member = init_from_env()
        groups = HSDPGroups(pg.store, HSDPLayout(ft.replicas, world // ft.replicas), slot=slot, backend=pg.adapter_name)
        self.ft_groups = groups
        self.ft_manager = manager = Manager(pg, member, hsdp=groups, sync_timeout=ft.sync_timeout,
                                            check_every=ft.check_every)
        restart = int(os.environ.get("FTC10D_RESTART_COUNT", "0"))
        self.ft_events = _Events(ft.events, f"slot{slot}.{restart}", slot=slot, restart=restart,
                                 replica=groups.replica, shard=groups.shard_index, pid=os.getpid())
        self.ft_events.emit("admitted", rank=manager.rank, world_size=manager.world_size, epoch=manager.epoch)
        manager.add_listener(lambda kind, info: self.ft_events.emit(kind, **info))
        mesh = manager.device_mesh()  # waits until this rank's replica is complete
        return FTParallelDims(self.config.parallelism, mesh, replicas=ft.replicas, replica=groups.replica,
                              shard_index=groups.shard_index)

    def __init__(self, config: "FaultTolerantTrainer.Config") -> None:
        with _received_parameters(self._awaiting_model):
            super().__init__(config)
        if len(self.model_parts) != 1 or len(self.optimizers.optimizers) != 1:
            raise InvalidOptionError("ftc10d's torchtitan trainer needs one model part and one optimizer "
                                     f"(got {len(self.model_parts)} and {len(self.optimizers.optimizers)}): "
                                     "pipeline parallelism and per-group optimizers are not supported yet")
        manager = self.ft_manager
        # every name first: a replacement's received state is applied in fsdp(), all of it at once
        manager.register("lr_schedulers", state_dict=self.lr_schedulers.state_dict,
                         load_state_dict=self.lr_schedulers.load_state_dict)
        manager.fsdp(self.model_parts[0], self.optimizers.optimizers[0])
        from ftc10d.train.fsdp import FSDPSettings

        self.ft_fsdp_settings = FSDPSettings(self.model_parts[0])  # restored before every step
        # A step whose vote completed elsewhere is applied here at recovery (Manager._roll_forward_to
        # steps the optimizer with the step's gradients): its LR step goes with it.
        manager.add_listener(lambda kind, info: self.lr_schedulers.step() if kind == "rolled_forward" else None)
        # The data position is a function of the committed step (StepBatches), not a loader state.
        getattr(self.checkpointer, "states", {}).pop("dataloader", None)

    def _awaiting_model(self) -> bool:
        """Whether this rank is a replacement whose received state waits for the model
        (``init_distributed``, called first in torchtitan's ``__init__``, received it)."""
        manager = getattr(self, "ft_manager", None)
        return manager is not None and manager.awaiting_model

    # ------------------------------------------------------------ training

    def train(self) -> None:
        config, manager = self.config, self.ft_manager
        if int(os.environ.get("FTC10D_RESTART_COUNT", "0")) == 0 and manager.step == 0:
            # a job's start (every rank at once): torchtitan's own load, if there is a checkpoint
            if self.checkpointer.load(step=config.checkpoint.load_step) and self.step:
                manager.step = self.step  # the Manager counts committed steps from the checkpoint's
                self.ft_events.emit("restored", step=self.step, fp=self.state_fingerprint())
        # (a replacement receives the live state in its first zero_grad instead)
        batches = StepBatches(self.batch_generator(self.dataloader))
        logger.info("ftc10d: training from step %d to %d", manager.step + 1, config.training.steps)
        last_commit = time.monotonic()
        longest = 0.0
        while manager.step < config.training.steps:
            t0 = time.time()
            try:
                # recover first (a roll-forward applies the last step's gradients), then zero them
                manager.start_step()
                self.optimizers.zero_grad()
            except JobFinished as exc:
                self.ft_events.emit("left", step=manager.step, reason=str(exc))
                break
            k = manager.step
            self.step = k + 1
            self.ft_fsdp_settings.restore()
            lr_metrics = self.lr_schedulers.get_metrics()
            input_dict, labels = batches.for_step(k)
            loss = grad_norm = None
            with manager.collectives():  # a failed collective fails the step, not the process
                try:
                    loss, grad_norm = self._forward_backward(input_dict, labels)
                except Exception as exc:
                    self.ft_events.emit("step_failed", step=k, error=f"{type(exc).__name__}: {exc}"[:1000])
                    raise
            ok = manager.should_commit()
            if ok:
                self.optimizers.step()
                self.lr_schedulers.step()
            now = time.monotonic()
            pause = now - last_commit
            if ok:
                last_commit, longest = now, max(longest, pause)
            info = {"loss": float(loss) if ok and loss is not None else None,
                    "grad_norm": float(grad_norm) if ok and grad_norm is not None else None}
            self.ft_events.emit("step", step=manager.step, ok=ok, t0=t0, dt=time.time() - t0, since_commit=pause,
                                epoch=manager.epoch, rank=manager.rank, world_size=manager.world_size,
                                replicas=self.ft_groups.replicate.size(), **info)
            if not ok:
                continue
            if info["loss"] is not None and not math.isfinite(info["loss"]):
                raise RuntimeError(f"Loss is not finite ({info['loss']}) at committed step {manager.step}. "
                                   "Stopping training.")  # torchtitan's check, on committed steps
            every = config.ftc10d.fingerprint_every
            if every and (manager.step % every == 0 or manager.step == config.training.steps):
                self.ft_events.emit("fingerprint", step=manager.step, fp=manager.fingerprint(),
                                    commit_epoch=manager.commit_epoch)
            if self.metrics_processor.should_log(self.step) and loss is not None:
                self.metrics_processor.log(self.step, info["loss"], info["loss"], info["grad_norm"],
                                           extra_metrics={**lr_metrics, "ftc10d/longest_pause_s": longest,
                                                          "ftc10d/members": manager.world_size,
                                                          "ftc10d/replicas": self.ft_groups.replicate.size()})
            self.checkpointer_save(manager.step)
        self.ft_events.emit("final", step=manager.step, hash=manager.state_hash(), epoch=manager.epoch,
                            longest_pause=longest)
        if manager.step >= config.training.steps:
            # Leave together: a rank that exits while the last checkpoint is being written by
            # another replica would make the membership abort that replica's groups under it.
            try:
                self.ft_groups.participants.barrier().wait()
            except Exception as exc:  # noqa: BLE001 - a peer gone at the very end: nothing left to wait for
                logger.info("ftc10d: final barrier: %s", exc)

    def _forward_backward(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's gradients (torchtitan's forward_backward_step and clipping), its loss
        summed over the replica (torchtitan's global average within the replica)."""
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        dims = self.parallel_dims
        local_tokens = (labels != IGNORE_INDEX).sum()
        tokens = dist_utils.dist_sum_tensor(local_tokens.to(self.device), dims.shard_mesh) \
            if dims.dp_cp_enabled else local_tokens.to(self.device)
        input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
        loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                          global_valid_tokens=tokens).detach()
        grad_norm = dist_utils.clip_grad_norm_([p for m in self.model_parts for p in m.parameters()],
                                               self.config.training.max_norm, foreach=True, pp_mesh=None,
                                               ep_enabled=False)
        if dims.dp_cp_enabled:
            loss = dist_utils.dist_sum_tensor(loss, dims.shard_mesh)
        return loss, grad_norm

    def state_fingerprint(self) -> str:
        """The fingerprint of this rank's training state (model and optimizer shards, LR
        schedulers), without the Manager's own bookkeeping: equal on every holder of a shard
        at a step, and equal to it again once restored from that step's checkpoint."""
        from ftc10d.train.state import fingerprint

        state = self.ft_manager.state_dict()
        state.pop("ftc10d", None)
        return fingerprint(state)

    def checkpointer_save(self, step: int) -> None:
        """torchtitan's checkpoint at its interval, written by one complete replica (:mod:`.checkpoint`)."""
        from ftc10d.integrations.torchtitan.checkpoint import save_if_due

        save_if_due(self, step)

    def close(self) -> None:
        manager = getattr(self, "ft_manager", None)
        if manager is not None:
            manager.close()
        events = getattr(self, "ft_events", None)
        if events is not None:
            events.close()
        super().close()

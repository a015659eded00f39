"""torchtitan's checkpoints under FT-HSDP: one complete replica writes them.

torchtitan's ``CheckpointManager`` saves with DCP over the default group: every rank of the
world, all at once. Under FT-HSDP the replicas hold the same state, a replica may be
incomplete (waiting for a replacement) while the others commit, and the world group is
reconfigured under it. So at torchtitan's interval (``--checkpoint.interval``, and the last
step) the *first complete replica* of the current configuration (the lowest index in its
placement's complete replicas: every rank of the configuration derives the same one) writes the checkpoint with DCP
over its shard group: model and optimizer shards, the LR schedulers and the step, in
torchtitan's layout (``<dump>/<checkpoint.folder>/step-N``), so torchtitan loads it as its own.

Loading is torchtitan's, at the start of a job only (a replacement receives live state
instead): ``ftc10d.integrations.torchtitan.train`` restarts a job that raised
``StateLostError`` from the newest checkpoint (see its docstring).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

import torch

logger = logging.getLogger("ftc10d")


@contextlib.contextmanager
def _world_ranks(group: Any, world_rank: int) -> Iterator[None]:
    """DCP addresses the members of ``process_group`` by their ranks in the default (world)
    group, through torch's registry of the group's ranks. A shard group is registered with its
    members' slots, which are world ranks only until the world's first reconfigure (world ranks
    follow membership order): for the save, the members' current world ranks (one all-gather)."""
    import torch.distributed.distributed_c10d as c10d

    mine = torch.tensor([world_rank], dtype=torch.int64)
    ranks = [torch.zeros_like(mine) for _ in range(group.size())]
    group.allgather([ranks], [mine]).wait()
    registry = c10d._world.pg_group_ranks
    saved = registry.get(group)
    registry[group] = {int(r.item()): i for i, r in enumerate(ranks)}
    try:
        yield
    finally:
        if saved is not None:
            registry[group] = saved


def due(trainer: Any, step: int) -> bool:
    """Whether torchtitan's checkpoint settings ask for a checkpoint of committed ``step``."""
    ckpt = trainer.checkpointer
    if not getattr(ckpt, "enable", False) or getattr(ckpt, "load_only", False):
        return False
    return step == trainer.config.training.steps or step % ckpt.interval == 0


def save_if_due(trainer: Any, step: int) -> bool:
    """Write the checkpoint of committed ``step`` if it is due and this rank's replica is the
    first complete one; returns whether this rank wrote its part."""
    import torch.distributed.checkpoint as dcp

    groups = trainer.ft_groups
    placement = groups.placement
    if not due(trainer, step) or placement is None or not placement.complete or \
            groups.replica != placement.complete[0]:
        return False
    ckpt = trainer.checkpointer
    t0 = time.monotonic()
    shard = groups.shard
    # FT-HSDP's shard group hands its failures to the Manager and completes the op with whatever
    # its outputs hold (FSDP2 must run to its end); DCP's object collectives would unpickle that:
    # for the save, a failure raises, and the checkpoint of this step is skipped, not the job.
    sink = shard._error_sink
    shard.swallow_errors(None)
    try:
        states = ckpt._flattened_model_states_sd()
        with _world_ranks(shard, trainer.ft_manager.rank):
            dcp.save(states, checkpoint_id=ckpt._create_checkpoint_id(step), process_group=shard)
    except Exception as exc:  # noqa: BLE001 - a lost peer, a full disk: the training goes on
        logger.warning("ftc10d: the checkpoint of step %d was not written (%s: %s); the next one will be",
                       step, type(exc).__name__, exc)
        trainer.ft_events.emit("checkpoint_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500])
        return False
    finally:
        shard.swallow_errors(sink)
    trainer.ft_events.emit("checkpoint", step=step, seconds=time.monotonic() - t0, fp=trainer.state_fingerprint())
    logger.info("ftc10d: checkpoint of step %d written by replica %d in %.2f s", step, trainer.ft_groups.replica,
                time.monotonic() - t0)
    return True

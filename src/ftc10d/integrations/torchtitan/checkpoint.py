"""torchtitan's checkpoints under FT-HSDP: one complete replica writes them.

torchtitan's ``CheckpointManager`` saves with DCP over the default group: every rank of the
world, all at once. Under FT-HSDP the replicas hold the same state, a replica may be
incomplete (waiting for a replacement) while the others commit, and the world group is
reconfigured under it. So at torchtitan's interval (``--checkpoint.interval``, and the last
step) the *first complete replica* of the current configuration (rank 0 of the replicate
group: every rank of that replica knows it, the others skip) writes the checkpoint with DCP
over its shard group: model and optimizer shards, the LR schedulers and the step, in
torchtitan's layout (``<dump>/<checkpoint.folder>/step-N``), so torchtitan loads it as its own.

Loading is torchtitan's, at the start of a job only (a replacement receives live state
instead): ``ftc10d.integrations.torchtitan.train`` restarts a job that raised
``StateLostError`` from the newest checkpoint (see its docstring).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("ftc10d")


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

    if not due(trainer, step) or trainer.ft_groups.replicate.rank() != 0:
        return False
    ckpt = trainer.checkpointer
    t0 = time.monotonic()
    states = ckpt._flattened_model_states_sd()
    dcp.save(states, checkpoint_id=ckpt._create_checkpoint_id(step), process_group=trainer.ft_groups.shard)
    trainer.ft_events.emit("checkpoint", step=step, seconds=time.monotonic() - t0)
    logger.info("ftc10d: checkpoint of step %d written by replica %d in %.2f s", step, trainer.ft_groups.replica,
                time.monotonic() - t0)
    return True

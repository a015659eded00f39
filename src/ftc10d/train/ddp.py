"""torch's own DistributedDataParallel, over an ftc10d group that changes under it.

Two things of torch's DDP do not survive a membership change, and this module
handles both without touching torch's code:

- The reducer averages by the size the group had when it was built, and its
  default all-reduce raises into the backward pass when a peer dies. A comm
  hook (:func:`allreduce_hook`) all-reduces each bucket through the group and
  divides by the *current* number of participants; a failure is handed to the
  Manager (the step will not commit) and the bucket is returned as it is, so
  the reducer's own state stays consistent.
- A reducer broadcasts its bucket order from rank 0 in its second iteration
  ("rebuild buckets"). A joiner's fresh reducer would do that alone and
  desynchronize everyone. So every rank rebuilds its DDP after every
  configuration change (without DDP's init-time collectives: the Manager's
  recovery already made the parameters equal), and all reducers go through
  their first iterations together.
"""

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from ftc10d.train.manager import Manager

logger = logging.getLogger("ftc10d")


# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations
# and wants the real GradBucket and Future[Tensor] types.
def allreduce_hook(manager: "Manager", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket over the current participants; never fails. The
    last bucket of a backward pass carries the commit vote (``Manager(vote="fused")``)."""
    if bucket.is_last():
        return manager.allreduce_with_vote(bucket.buffer())
    return manager.allreduce(bucket.buffer())


class DistributedDataParallel(nn.Module):
    """Holds a ``torch.nn.parallel.DistributedDataParallel`` of ``module`` over
    ``manager.pg``, rebuilt by the Manager after each configuration change.

    Use it like torch's DDP: call it, ``no_sync()``; ``.module`` is the model.
    Create it with :meth:`Manager.ddp`.
    """

    def __init__(self, module: nn.Module, manager: "Manager", **ddp_kwargs: Any) -> None:
        super().__init__()
        for bad in ("process_group", "init_sync", "device_mesh"):
            if bad in ddp_kwargs:
                from ftc10d.types import InvalidOptionError

                raise InvalidOptionError(f"{bad}= is set by ftc10d (the manager's group, no init-time sync); drop it")
        self.module = module
        self._manager = manager
        self._kwargs = ddp_kwargs
        self._ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None
        self.rebuild()

    def rebuild(self) -> None:
        """A fresh torch DDP over the group's current configuration."""
        old = self.__dict__.get("_ddp")
        if old is not None:
            old.reducer._remove_autograd_hooks()
        ddp = torch.nn.parallel.DistributedDataParallel(
            self.module, process_group=self._manager.pg, init_sync=False, **self._kwargs
        )
        ddp.register_comm_hook(self._manager, allreduce_hook)
        # Not a registered submodule: the model's parameters appear once, under .module.
        self.__dict__["_ddp"] = ddp

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        ddp = self.__dict__["_ddp"]
        assert ddp is not None
        return ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.ddp(*args, **kwargs)
        except RuntimeError as exc:
            # DDP's own collectives in forward (bucket rebuild, buffer broadcast) cross C++,
            # so a typed error arrives as RuntimeError: decide by the group's state.
            if not self._manager.note_failure(exc):
                raise
            logger.warning("ftc10d DDP: forward collective failed (%s); this step will not commit", exc)
            return self.module(*args, **kwargs)

    def no_sync(self) -> Any:
        return self.ddp.no_sync()

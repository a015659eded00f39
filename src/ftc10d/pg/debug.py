"""torch's ``dist.monitored_barrier`` on ftc10d groups.

Users debug a hang with ``dist.monitored_barrier()``: rank 0 names the ranks that did not
arrive. torch refuses any group whose backend is not named "gloo" (2.11-2.13: "monitored_barrier
is only implemented for GLOO backend"; newer ones ask the group for a CPU backend it does not
register), although an ftc10d group runs Gloo underneath. So, as for torch's hook helpers
(:mod:`ftc10d.pg.torch_hooks`), ftc10d wraps ``torch.distributed.monitored_barrier`` when it is
imported: a call whose group (or default group) is an ftc10d group goes to
:meth:`ftc10d.ProcessGroup.monitored_barrier`, which runs Gloo's own on the current
configuration (torch's messages, word for word); every other call goes to torch's function,
unchanged. torch's argument handling is kept: ``timeout`` None is the group's timeout, a float
is taken as seconds with torch's warning.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_installed = False


def _ftc10d_group(group: Any) -> Any:
    from ftc10d.pg.process_group import ProcessGroup

    if group is None:
        group = c10d._world.default_pg if dist.is_initialized() else None
    return group if isinstance(group, ProcessGroup) else None


def install() -> None:
    """Wrap ``monitored_barrier`` in ``torch.distributed`` and ``distributed_c10d`` (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    original = c10d.monitored_barrier

    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Optional[Any] = None, wait_all_ranks: bool = False) -> Any:
        pg = _ftc10d_group(group)
        if pg is None:
            return original(group, timeout, wait_all_ranks)
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                          f"{timeout} assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier

"""Sub-groups of an ftc10d group through torch's own APIs.

DeviceMesh, FSDP2, tensor parallelism and torchtitan make their groups with
``torch.distributed.new_group`` (and ``new_subgroups``, ``init_device_mesh``) on the
backend of the default group. We register ``"ftc10d"`` as a torch backend whose
creator returns an ftc10d :class:`ProcessGroup` (torch then files it as a group of
its own: name, ranks, tags; ``destroy_process_group`` works on it), so a sub-group is
abortable, recorded and typed like its parent.

Two things differ from a Gloo sub-group, on purpose:

- **Where its members meet.** torch keys a sub-group's store by a per-process
  counter of groups created. A replacement process started after a failure has
  created fewer groups than the survivors, so those keys would never match. A
  sub-group of an ftc10d parent meets under the parent's store at
  ``ftc10d/sub/<parent uuid>/<global ranks>/<n>``, ``n`` counting the groups made with
  those ranks in that configuration of the parent: every member of a new
  configuration agrees on it, whatever it did before.
- **It follows its parent's configuration.** Its ranks are ranks of the parent's
  configuration at creation. When the parent reconfigures, every sub-group made from
  the old configuration is aborted, and its ops raise
  :class:`ftc10d.ParentReconfiguredError` naming the new one; create them again (one
  ``init_device_mesh`` call rebuilds a mesh), on every member of the new configuration.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ftc10d.pg.channels import default_backend
from ftc10d.pg.process_group import DEFAULT_TIMEOUT, ProcessGroup
from ftc10d.types import ErrorType, InvalidOptionError, NotConfiguredError, ParentReconfiguredError

logger = logging.getLogger("ftc10d")

BACKEND_NAME = "ftc10d"
_lock = threading.Lock()


def register_backend() -> None:
    """Make ``"ftc10d"`` a torch backend name (idempotent; done when ftc10d is imported)."""
    with _lock:
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def _create(opts: Any, backend_options: Any = None) -> ProcessGroup:
    """torch's backend creator (``_DistributedBackendOptions``): called on the members only."""
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else DEFAULT_TIMEOUT
    parent = c10d._world.default_pg
    ranks = [int(r) for r in (opts.global_ranks_in_group or [])]
    enable_reconfigure = bool(getattr(opts, "enable_reconfigure", False))
    if isinstance(parent, ProcessGroup) and parent.generation is not None and ranks:
        store = _child_store(parent, ranks)
    else:  # the default group itself (dist.init_process_group("ftc10d")), or a non-ftc10d parent
        parent, store = None, opts.store
    # a sub-group carries its parent's tensors: the same adapter (ftc10d.pg.backend)
    # (the default group: cpu:gloo,cuda:nccl where CUDA and NCCL run, as torch picks; FTC10D_BACKEND overrides)
    backend = parent._backend_name if parent is not None else default_backend()
    pg = ProcessGroup(store, int(opts.group_rank), int(opts.group_size), timeout=timeout, backend=backend,
                      enable_reconfigure=enable_reconfigure and parent is None, _torch_files_it=True)
    if parent is not None:
        _adopt(parent, pg)
    return pg


# ------------------------------------------------------------ parent and children


class _Children:
    """The sub-groups made from one parent, and how many with each set of ranks per configuration."""

    def __init__(self) -> None:
        self.groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
        self.made: dict[tuple[str, Any, tuple[int, ...]], int] = {}
        self.lock = threading.Lock()


def _children(parent: ProcessGroup) -> _Children:
    kids = getattr(parent, "_ftc10d_children", None)
    if kids is None:
        with _lock:
            kids = getattr(parent, "_ftc10d_children", None)
            if kids is None:
                kids = _Children()
                parent._ftc10d_children = kids  # type: ignore[attr-defined]
    return kids


def _child_store(parent: ProcessGroup, ranks: list[int], kind: str = "sub") -> dist.Store:
    gen = parent.generation
    assert gen is not None
    kids = _children(parent)
    key = (kind, gen.uuid, tuple(ranks))
    with kids.lock:
        n = kids.made.get(key, 0)
        kids.made[key] = n + 1
    where = "init" if gen.uuid is None else str(gen.uuid)
    return dist.PrefixStore(f"ftc10d/{kind}/{where}/{','.join(map(str, ranks))}/{n}/", parent._store)


def _adopt(parent: ProcessGroup, child: ProcessGroup) -> None:
    gen = parent.generation
    child._parent_uuid = None if gen is None else gen.uuid  # type: ignore[attr-defined]
    _children(parent).groups.add(child)


def orphan_children(parent: ProcessGroup, new_uuid: Optional[int]) -> int:
    """Abort every sub-group made from an older configuration of ``parent`` (called by
    its ``reconfigure`` once the old configuration is aborted); returns how many."""
    kids = getattr(parent, "_ftc10d_children", None)
    if kids is None:
        return 0
    n = 0
    for child in list(kids.groups):
        gen = child.generation
        if gen is None or getattr(child, "_parent_uuid", None) == new_uuid:
            continue
        gen.aborted_error_type = ParentReconfiguredError
        gen.aborted_hint = (
            f"It is a sub-group of {parent.group_name}, reconfigured to uuid {new_uuid}: create it again on every "
            "member of the new configuration (dist.new_group / new_subgroups / init_device_mesh)."
        )
        gen.abort(ErrorType.COMM_ERROR, f"its parent group was reconfigured from uuid {child._parent_uuid} "
                  f"to {new_uuid}")
        kids.groups.discard(child)
        n += 1
    if n:
        logger.info("%s: aborted %d sub-group(s) of its previous configuration", parent.group_name, n)
    return n


def split(parent: ProcessGroup, new_ranks: Any, timeout: Optional[timedelta] = None,
          group_desc: Optional[str] = None) -> Optional[ProcessGroup]:
    """``ProcessGroup.split_group`` of an ftc10d group: a new ftc10d group on ``new_ranks``
    (ranks of ``parent``'s current configuration, in the new group's rank order) for its
    members, None for the others; it follows ``parent``'s configuration as ``new_group``'s do."""
    gen = parent.generation
    if gen is None:
        raise NotConfiguredError("split_group on an ftc10d group that has no configuration yet; reconfigure it first")
    ranks = _check_ranks(new_ranks, gen.size)
    if gen.rank not in ranks:
        return None
    store = _child_store(parent, ranks, kind="split")
    child = ProcessGroup(store, ranks.index(gen.rank), len(ranks), timeout=timeout or parent.timeout,
                         backend=parent._backend_name)
    if group_desc:
        child._set_group_desc(group_desc)
    _adopt(parent, child)
    return child


def _check_ranks(new_ranks: Any, size: int) -> list[int]:
    try:
        ranks = [int(r) for r in new_ranks]
    except (TypeError, ValueError):
        raise InvalidOptionError(f"split_group: new_ranks must be a list of ints, got {new_ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or any(r < 0 or r >= size for r in ranks):
        raise InvalidOptionError(
            f"split_group: new_ranks must be distinct ranks of the group, in [0, {size}), got {list(new_ranks)}"
        )
    return ranks

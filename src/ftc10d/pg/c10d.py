"""Make torch.distributed know our groups: registration, rank maps, the default group.

``torch.distributed`` keeps per-group bookkeeping in ``_world`` (backend name,
store, group name, global->group rank map) and resolves groups by name for the
functional collectives. A group built by ``new_group`` gets all of it; ours is
built directly, so we fill the same tables, and refresh the rank map after every
reconfigure since ranks move. We write the tables rather than call torch's
private helpers because those helpers' signatures change between releases while
the tables have been stable since torch 2.0.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _register_process_group

from ftc10d.pg.handles import options as _options
from ftc10d.pg.process_group import DEFAULT_TIMEOUT, ProcessGroup
from ftc10d.store_connect import skip_reverse_dns
from ftc10d.types import InvalidOptionError

logger = logging.getLogger("ftc10d")

BACKEND_NAME = "ftc10d"


def _default_group() -> Optional[dist.ProcessGroup]:
    return c10d._world.default_pg


_first_rank: Optional[int] = None


def note_rank(rank: int) -> None:
    """Remember this process's rank in the first configuration it joins."""
    global _first_rank
    if _first_rank is None and rank >= 0:
        _first_rank = rank


def process_rank() -> int:
    """A stable identity for this process across reconfigures: ``RANK`` if set,
    else its rank in the first ftc10d configuration it joined (0 before any)."""
    env = os.environ.get("RANK", "").strip()
    if env.isdigit():
        return int(env)
    return _first_rank if _first_rank is not None else 0


def global_rank(pg: ProcessGroup) -> int:
    """What this process publishes as its global rank: its rank in a non-ftc10d
    default group if there is one, else its stable :func:`process_rank`."""
    default = _default_group()
    if default is None or isinstance(default, ProcessGroup):
        return process_rank()
    return default.rank()


def register(pg: ProcessGroup) -> None:
    # Same name on every rank (groups are made in the same order everywhere, as with
    # torch's counter), so that dumps of different ranks name the same group.
    name = f"ftc10d_{pg._group_id}"
    pg._set_group_name(name)
    pg._set_group_desc(name)
    c10d._world.pg_map[pg] = (BACKEND_NAME, pg._store)
    c10d._world.pg_names[pg] = name
    c10d._world.pg_backend_config[pg] = BACKEND_NAME
    c10d._world.pg_group_ranks[pg] = {}
    # The tags torch's new_group gives a group, which destroy_process_group expects.
    tag = f"ptd:{name}"
    c10d._world.pg_to_tag[pg] = tag
    c10d._world.tags_to_pg.setdefault(tag, []).append(pg)
    c10d._world.tags_to_pg.setdefault("", []).append(pg)
    _register_process_group(name, pg)


def update_ranks(pg: ProcessGroup) -> None:
    """Refresh the global->group rank map of ``pg`` after a (re)configuration."""
    gen = pg.generation
    if gen is None:
        return
    default = _default_group()
    if default is None or default is pg:
        # No other world to translate from: "global" ranks are the group's own,
        # so dist.send(t, dst, group=pg) takes the current group rank.
        c10d._world.pg_group_ranks[pg] = {r: r for r in range(gen.size)}
        if default is pg:
            c10d._update_default_pg(pg)  # refreshes torch's cached global rank
    else:
        c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(gen.global_ranks)}


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    world_size: int = -1,
    rank: int = -1,
    store: Optional[dist.Store] = None,
    *,
    enable_reconfigure: bool = False,
) -> ProcessGroup:
    """Like ``torch.distributed.init_process_group``, with an ftc10d group as the default group.

    Rank, world size and store come from the arguments, ``init_method`` or the
    environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), as in torch.
    ``backend``: the group's adapter or channels (``"gloo"``, ``"cpu:gloo,cuda:nccl"``); None picks
    as torch does (:func:`ftc10d.pg.channels.default_backend`).
    """
    if dist.is_initialized():
        raise InvalidOptionError(
            "a default process group is already initialized; call torch.distributed.destroy_process_group() first"
        )
    if store is None:
        if init_method is None:
            init_method = "env://"
        skip_reverse_dns()  # rank 0's store server looks up every rank that connects (store_connect.py)
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore("default_pg", store)
    elif rank < 0 or world_size <= 0:
        raise InvalidOptionError("with an explicit store, pass rank and world_size too")
    # Become the default first so that rank maps and the global rank are ours.
    pg = ProcessGroup.__new__(ProcessGroup)
    c10d._world.default_pg = pg  # torch reads the default group through this
    try:
        if backend is None:
            from ftc10d.pg.channels import default_backend

            backend = default_backend()
        pg.__init__(store, rank, world_size, backend=backend, timeout=timeout, enable_reconfigure=enable_reconfigure)
    except BaseException:
        c10d._world.default_pg = None
        raise
    c10d._update_default_pg(pg)
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(pg.size())}
    logger.info("ftc10d default group initialized: rank %d of %d", pg.rank(), pg.size())
    return pg


def set_default_group(pg: ProcessGroup) -> None:
    """Make an existing ftc10d group torch's default group (``DeviceMesh`` needs one; a
    group made by ``ftc10d.train.init_from_env`` is not one). Idempotent for ``pg``."""
    default = _default_group()
    if default is pg:
        return
    if default is not None:
        raise InvalidOptionError("another default process group is initialized; call "
                                 "torch.distributed.destroy_process_group() first")
    c10d._world.default_pg = pg
    c10d._update_default_pg(pg)
    update_ranks(pg)


def _group(group: Optional[dist.ProcessGroup]) -> ProcessGroup:
    pg = group if group is not None else _default_group()
    if pg is None:
        raise InvalidOptionError("no group given and no default process group; pass group= or call init_process_group")
    if not isinstance(pg, ProcessGroup):
        raise InvalidOptionError(
            f"{type(pg).__name__} is not an ftc10d group; "
            "create it with ftc10d.ProcessGroup or ftc10d.init_process_group"
        )
    return pg


def get_reconfigure_handle(group: Optional[dist.ProcessGroup] = None) -> str:
    """Mirror of ``torch.distributed._get_reconfigure_handle``."""
    return _group(group).get_reconfigure_handle()


def reconfigure(
    uuid: int,
    handles: Any,
    group: Optional[dist.ProcessGroup] = None,
    timeout: Optional[timedelta] = None,
    hints: Optional[dict[str, str]] = None,
) -> dist.Work:
    """Mirror of ``torch.distributed._reconfigure``: rebuild ``group`` with ``handles``."""
    return _group(group).reconfigure(_options(uuid, handles, timeout, hints))


def supports_reconfigure(group: Optional[dist.ProcessGroup] = None) -> bool:
    return _group(group).supports_reconfigure

"""``LaunchConfig``: what ``ftc10d launch`` was asked to do, checked before anything starts.

Validation lives here, apart from the supervisor, so that the CLI and the
``Launcher`` reject the same mistakes with the same words, before a single
process is spawned or a port is bound. Every error is an
:class:`ftc10d.InvalidOptionError` whose message says what to do.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from ftc10d.membership.records import TOKEN_ENV
from ftc10d.types import InvalidOptionError

logger = logging.getLogger("ftc10d")


def parse_address(address: str, what: str = "--coordinator") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> ``(host, port)``; InvalidOptionError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidOptionError(f"{what} {address!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
    return host, int(port)


@dataclass
class LaunchConfig:
    """Options of one launcher (one node). See ``specs/launch-api.md``."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    spares: int = 0
    max_restarts: int = 3
    coordinator: Optional[str] = None
    #: etcd client URLs: membership lives there (the coordinator store keeps the group's rendezvous).
    membership_endpoints: Optional[list[str]] = None
    host: str = "127.0.0.1"
    port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    heartbeat_timeout: float = 1.0
    min_members: Optional[int] = None
    token: Optional[str] = None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Optional[str] = None
    python: str = sys.executable
    #: GPUs this node's workers share (None: those visible, ``CUDA_VISIBLE_DEVICES`` or CUDA's
    #: count). More workers than GPUs means ranks share a GPU: NCCL then needs a distinct
    #: ``NCCL_HOSTID`` per rank (else "Duplicate GPU detected"), which the launcher sets.
    gpus_per_node: Optional[int] = None
    #: ``"node"``: the launcher is its node's member (a node agent) and its workers go through it,
    #: so the store's load grows with nodes, not ranks; ``"rank"``: every worker is a member of
    #: its own, as without the launcher.
    membership_unit: str = "node"

    @property
    def world_size(self) -> int:
        """Slots of the whole job: every node runs ``nproc_per_node``."""
        return self.nnodes * self.nproc_per_node

    @property
    def effective_min_members(self) -> int:
        """``--min-members``, else the default: 1 on one node (its launcher runs the whole job
        and sees every exit, and a job should survive losing all but one worker), a majority
        of the job's world size on several nodes. There a node cut off from the others (or a
        straggler rejoining after they left) must never form a configuration of its own and
        train on apart: only one side of a split can hold a majority."""
        if self.min_members is not None:
            return self.min_members
        return 1 if self.nnodes == 1 else self.world_size // 2 + 1

    @property
    def effective_token(self) -> Optional[str]:
        """The explicit token, else ``$FTC10D_TOKEN``, else None (unsigned records)."""
        return self.token if self.token is not None else (os.environ.get(TOKEN_ENV) or None)

    def validate(self) -> None:
        """Raise InvalidOptionError naming the first bad option and how to fix it."""
        if not self.script:
            raise InvalidOptionError("no training script given: ftc10d launch [options] script.py [args...]")
        if not os.path.isfile(self.script):
            raise InvalidOptionError(f"training script {self.script!r} does not exist or is not a file; "
                                     "give the path of a Python file")
        if self.nproc_per_node < 1:
            raise InvalidOptionError(f"--nproc-per-node must be at least 1 (got {self.nproc_per_node})")
        if self.spares < 0:
            raise InvalidOptionError(f"--spares must be 0 or more (got {self.spares}); 0 disables warm spares")
        if self.max_restarts < 0:
            raise InvalidOptionError(f"--max-restarts must be 0 or more (got {self.max_restarts}); "
                                     "0 never respawns a failed worker")
        if self.nnodes < 1:
            raise InvalidOptionError(f"--nnodes must be at least 1 (got {self.nnodes})")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise InvalidOptionError(f"--gpus-per-node must be 0 or more (got {self.gpus_per_node}); 0: no GPU")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidOptionError(f"--node-rank must be in [0, {self.nnodes}) (got {self.node_rank}); "
                                     "number the nodes 0..nnodes-1")
        if self.nnodes > 1 and self.coordinator is None and self.node_rank != 0:
            raise InvalidOptionError("on a node other than node 0, give --coordinator HOST:PORT (node 0's launcher "
                                     "or an `ftc10d coordinator`), so that every node joins the same membership")
        if self.nnodes > 1 and self.coordinator is None and self.host in ("127.0.0.1", "localhost", "::1"):
            raise InvalidOptionError("with --nnodes > 1, node 0's embedded coordinator must be reachable from the "
                                     "other nodes: give --host 0.0.0.0 (or this node's address) and a fixed --port")
        if not 0 <= self.port <= 65535:
            raise InvalidOptionError(f"--port must be in [0, 65535] (got {self.port}); 0 picks a free port")
        if self.coordinator is not None:
            parse_address(self.coordinator)
            if self.port:
                raise InvalidOptionError("--port only applies to the embedded coordinator; drop it or drop "
                                         "--coordinator")
        if self.membership_endpoints is not None:
            from ftc10d.train.bootstrap import parse_endpoints

            parse_endpoints(self.membership_endpoints)
            try:
                import etcd3gw  # noqa: F401
            except ImportError:
                raise InvalidOptionError("--membership-endpoints needs the etcd client: pip install 'ftc10d[etcd]' "
                                         "(etcd3gw), or drop the option to keep membership in the coordinator "
                                         "store") from None
        if self.membership_unit not in ("node", "rank"):
            raise InvalidOptionError(f"--membership-unit must be 'node' (one member per node: the launcher) or "
                                     f"'rank' (one per worker), got {self.membership_unit!r}")
        if not self.host:
            raise InvalidOptionError("--host must be an address to bind, e.g. 127.0.0.1 or 0.0.0.0")
        if not self.heartbeat_timeout > 0:
            raise InvalidOptionError(f"--heartbeat-timeout must be positive seconds (got {self.heartbeat_timeout})")
        if self.min_members is not None and self.min_members < 1:
            raise InvalidOptionError(f"--min-members must be at least 1 (got {self.min_members})")
        if self.min_members is not None and self.min_members > self.world_size:
            # The job can never have more members than slots (a replacement takes its slot's place,
            # a spare joins only when promoted into a slot): no configuration would ever form.
            raise InvalidOptionError(
                f"--min-members {self.min_members} is more than the job can ever have: {self.world_size} worker(s) "
                f"(--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node}), so no configuration would ever "
                f"form; give at most {self.world_size}, or count the other nodes' workers with --nnodes")
        if self.nnodes > 1 and self.effective_min_members > self.nproc_per_node:
            logger.info("launch: min_members %d is more than this node's %d slot(s): the job forms once other "
                        "nodes' workers joined", self.effective_min_members, self.nproc_per_node)
        if self.token is not None and not self.token:
            raise InvalidOptionError("the job token is empty; unset it or give a non-empty one")
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise InvalidOptionError(f"env entry {key!r}={value!r} is not NAME=string")
        if self.log_dir is not None and os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise InvalidOptionError(f"--log-dir {self.log_dir!r} exists and is not a folder")

"""The environment a worker is started with: torchrun's variables plus ftc10d's.

Kept apart from the supervisor so that a cold start (a fresh ``python script.py``)
and a warm one (a spare told its environment through a pipe) get exactly the
same variables. ``RANK`` is the slot's rank, a hint only: once the job runs,
ranks follow membership order (``ftc10d.train.init_from_env``).
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

from ftc10d.launch.config import LaunchConfig
from ftc10d.membership.local import NODE_AGENT_ENV
from ftc10d.membership.records import TOKEN_ENV
from ftc10d.train.bootstrap import (
    COORDINATOR_ENV,
    HEARTBEAT_ENV,
    LAUNCH_ID_ENV,
    MEMBERSHIP_ENDPOINTS_ENV,
    MEMBERSHIP_PREFIX_ENV,
    MIN_MEMBERS_ENV,
    parse_endpoints,
)

#: Restarts of the slot so far (torchrun's TORCHELASTIC_RESTART_COUNT, under our name too).
RESTART_ENV = "FTC10D_RESTART_COUNT"

#: Variables that depend on the slot (everything else is common to the node's workers and spares).
SLOT_VARS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", RESTART_ENV, "NCCL_HOSTID")
#: NCCL's host identity: ranks sharing one GPU must differ in it (``shared_gpu_host_id``).
NCCL_HOSTID = "NCCL_HOSTID"


def base_env(config: LaunchConfig, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """What every process of this launcher gets, spares included: the launcher's own
    environment, the config's extras, and the variables that do not depend on the slot.

    Spares are started with this, so anything read at import time (``OMP_NUM_THREADS``,
    ``TORCH_*``, ``FTC10D_FLIGHT_RECORDER``) already holds when the script is imported."""
    env = dict(os.environ if environ is None else environ)
    env.update(config.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if config.membership_endpoints is not None:  # job-wide: a spare pre-imports the etcd client for it
        env[MEMBERSHIP_ENDPOINTS_ENV] = ",".join(parse_endpoints(config.membership_endpoints))
    else:  # one inherited from the launcher's own environment would split the job's membership
        env.pop(MEMBERSHIP_ENDPOINTS_ENV, None)
        env.pop(MEMBERSHIP_PREFIX_ENV, None)
    return env


def visible_gpus(environ: Mapping[str, str]) -> int:
    """GPUs a worker of this node sees: ``CUDA_VISIBLE_DEVICES`` if set, else CUDA's count
    (0 without CUDA); read without creating a CUDA context in the launcher."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = []
        for d in (x.strip() for x in listed.split(",")):
            if not d or d == "-1":  # CUDA stops at the first invalid entry
                break
            devices.append(d)
        return len(devices)
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # no CUDA, or a driver problem: no GPU for the launcher's purpose
        return 0


def shared_gpu_host_id(config: LaunchConfig, local_rank: int, env: Mapping[str, str]) -> Optional[str]:
    """The ``NCCL_HOSTID`` of slot ``local_rank`` when this node runs more workers than it has
    GPUs (several NCCL ranks on one GPU), else None. NCCL refuses two ranks of one
    communicator on one GPU of one host ("Duplicate GPU detected"); with distinct host ids it
    connects them over its network transport. The real host name stays in it, so that ranks
    of different machines never look like one host."""
    gpus = config.gpus_per_node if config.gpus_per_node is not None else visible_gpus(env)
    if gpus < 1 or config.nproc_per_node <= gpus:
        return None
    base = env.get(NCCL_HOSTID) or socket.gethostname()
    return f"{base}-node{config.node_rank}-slot{local_rank}"


def worker_env(
    config: LaunchConfig,
    *,
    local_rank: int,
    restart: int,
    coordinator: str,
    launch_id: str,
    environ: Optional[Mapping[str, str]] = None,
    membership_prefix: Optional[str] = None,
    node_agent: Optional[str] = None,
) -> dict[str, str]:
    """The full environment of the worker of slot ``local_rank`` after ``restart`` restarts.
    ``membership_prefix``: the job's etcd key prefix (with ``config.membership_endpoints``);
    ``node_agent``: the socket of the launcher's node agent (``membership_unit="node"``)."""
    host, _, port = coordinator.rpartition(":")
    env = base_env(config, environ)
    env.update({
        "RANK": str(config.node_rank * config.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "GROUP_RANK": str(config.node_rank),
        "NODE_RANK": str(config.node_rank),
        "MASTER_ADDR": host.strip("[]"),
        "MASTER_PORT": port,
        # MASTER_PORT is the coordinator's store: torch's env:// rendezvous (a plain
        # dist.init_process_group) connects to it as a client, as to torchrun's agent store,
        # instead of rank 0 trying to host a store on that port (EADDRINUSE).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        RESTART_ENV: str(restart),
        COORDINATOR_ENV: coordinator,
        LAUNCH_ID_ENV: launch_id,
        HEARTBEAT_ENV: repr(float(config.heartbeat_timeout)),
        MIN_MEMBERS_ENV: str(config.effective_min_members),
    })
    host_id = shared_gpu_host_id(config, local_rank, env)
    if host_id is not None:
        env[NCCL_HOSTID] = host_id
    if node_agent:
        env[NODE_AGENT_ENV] = node_agent
    else:
        env.pop(NODE_AGENT_ENV, None)
    if config.membership_endpoints is not None and membership_prefix:
        env[MEMBERSHIP_PREFIX_ENV] = membership_prefix
    token = config.effective_token
    if token:
        env[TOKEN_ENV] = token
    else:
        env.pop(TOKEN_ENV, None)
    return env

"""A worker's first steps under ``ftc10d launch``: group, membership, admission.

Why not ``torch.distributed.init_process_group``: it waits for ``WORLD_SIZE``
ranks to arrive at one rendezvous, which a replacement started minutes later
can never do. Here every process creates an *unconfigured* ftc10d group (it
only has a reconfigure handle), joins the membership with that handle, and the
group is configured by the membership's first (or next) configuration: the
same code path serves the first start, a replacement and a rejoin.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

from ftc10d.membership import Member, MembershipStore, ReconnectingTCPStore, TCPMembershipStore
from ftc10d.membership.local import NODE_AGENT_ENV
from ftc10d.membership.records import TOKEN_ENV
from ftc10d.pg import ProcessGroup
from ftc10d.pg.channels import default_backend
from ftc10d.types import EXIT_STOP_JOB, InvalidOptionError, ReplicaDivergenceError, StateLostError

logger = logging.getLogger("ftc10d")

#: ``host:port`` of the coordinator store (set by ``ftc10d launch``).
COORDINATOR_ENV = "FTC10D_COORDINATOR"
#: Identifies one launcher; with the pid, the key under which a worker publishes its handle.
LAUNCH_ID_ENV = "FTC10D_LAUNCH_ID"
HEARTBEAT_ENV = "FTC10D_HEARTBEAT_TIMEOUT"
MIN_MEMBERS_ENV = "FTC10D_MIN_MEMBERS"
#: Comma-separated etcd endpoints (``ftc10d launch --membership-endpoints``): membership lives
#: there instead of in the coordinator store, which then only serves the group's rendezvous.
MEMBERSHIP_ENDPOINTS_ENV = "FTC10D_MEMBERSHIP_ENDPOINTS"
#: The job's key prefix in etcd (agreed by the job's launchers), so that jobs sharing a cluster,
#: or a rerun of the same job, never read each other's configurations.
MEMBERSHIP_PREFIX_ENV = "FTC10D_MEMBERSHIP_PREFIX"


def parse_endpoints(value: Union[str, Sequence[str]], what: str = "--membership-endpoints") -> tuple[str, ...]:
    """``"http://h1:2379,http://h2:2379"`` (or a list of them) -> the endpoints, each checked to
    be ``http(s)://host:port``; InvalidOptionError naming ``what`` otherwise. Checked here, before
    any process starts, because a bad endpoint would only show as workers that never get admitted."""
    items = value.split(",") if isinstance(value, str) else list(value)
    endpoints = tuple(str(e).strip().rstrip("/") for e in items if str(e).strip())
    if not endpoints:
        raise InvalidOptionError(f"{what} is empty; give the etcd cluster's client URLs, e.g. "
                                 "http://10.0.0.1:2379,http://10.0.0.2:2379,http://10.0.0.3:2379")
    for ep in endpoints:
        scheme, sep, rest = ep.partition("://")
        host, colon, port = rest.rpartition(":")
        if scheme not in ("http", "https") or not sep or not host.strip("[]") or not colon or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise InvalidOptionError(f"{what}: {ep!r} is not an etcd client URL; give http://HOST:PORT "
                                     "(comma-separated, e.g. http://127.0.0.1:2379,http://127.0.0.1:22379)")
    if len(set(endpoints)) != len(endpoints):
        raise InvalidOptionError(f"{what} names an endpoint twice: {', '.join(endpoints)}")
    return endpoints


def membership_store(host: str, port: int, endpoints: tuple[str, ...] = (),
                     prefix: Optional[str] = None) -> MembershipStore:
    """The membership backend of a job: etcd when ``endpoints`` are given, else the
    coordinator's TCPStore at ``host:port``. The launcher and its workers both build
    theirs here, so that an exit the launcher reports lands where the workers look."""
    if endpoints:
        from ftc10d.membership import EtcdMembershipStore

        return EtcdMembershipStore(list(endpoints), **({"prefix": prefix} if prefix else {}))
    return TCPMembershipStore(host, port)


def handle_key(launch_id: str, pid: int) -> str:
    """Where a worker started by launcher ``launch_id`` publishes its reconfigure handle,
    so that the launcher can name it to the membership the moment the process exits."""
    return f"ftc10d/launch/{launch_id}/pid/{pid}"


@dataclass(frozen=True)
class WorkerEnv:
    """What ``ftc10d launch`` (or torchrun-like tooling) tells a worker."""

    host: str
    port: int
    rank: int
    world_size: int
    launch_id: Optional[str]
    heartbeat_timeout: float
    min_members: int
    membership_endpoints: tuple[str, ...] = ()
    membership_prefix: Optional[str] = None

    def membership_store(self) -> MembershipStore:
        """etcd if the launcher named endpoints, else the coordinator store."""
        return membership_store(self.host, self.port, self.membership_endpoints, self.membership_prefix)

    @classmethod
    def from_environ(cls, environ: Optional[dict[str, str]] = None) -> "WorkerEnv":
        env = dict(os.environ if environ is None else environ)
        address = env.get(COORDINATOR_ENV)
        if not address:
            if "MASTER_ADDR" in env and "MASTER_PORT" in env:
                address = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            else:
                raise InvalidOptionError(
                    f"no coordinator: set {COORDINATOR_ENV}=host:port (ftc10d launch sets it), "
                    "or MASTER_ADDR and MASTER_PORT"
                )
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidOptionError(f"{COORDINATOR_ENV}={address!r} is not host:port")
        try:
            rank = int(env.get("RANK", "0"))
            world = int(env.get("WORLD_SIZE", "1"))
            hb = float(env.get(HEARTBEAT_ENV, "1.0"))
            min_members = int(env.get(MIN_MEMBERS_ENV, "1"))
        except ValueError as exc:
            raise InvalidOptionError(f"malformed launcher environment: {exc}") from exc
        if world < 1 or not 0 <= rank < world:
            raise InvalidOptionError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        raw = env.get(MEMBERSHIP_ENDPOINTS_ENV, "")
        endpoints = parse_endpoints(raw, MEMBERSHIP_ENDPOINTS_ENV) if raw.strip() else ()
        return cls(host.strip("[]"), int(port), rank, world, env.get(LAUNCH_ID_ENV), hb, min_members, endpoints,
                   env.get(MEMBERSHIP_PREFIX_ENV) or None)


def _check_cuda_device(backend: str) -> None:
    """An NCCL channel connects on the current CUDA device: a worker that did not pick its own
    (``torch.cuda.set_device(local_rank)``, as with torch's NCCL groups) would put every rank
    of the node on GPU 0. Say so before it happens."""
    if "nccl" not in backend:
        return
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and torch.cuda.device_count() > 1 and local and torch.cuda.current_device() == 0:
        logger.warning("ftc10d: LOCAL_RANK=%d but the current CUDA device is 0: call torch.cuda.set_device(%d) "
                       "before init_from_env() (its NCCL channel connects on the current device)",
                       local, local % torch.cuda.device_count())


def init_from_env(
    *,
    heartbeat_timeout: Optional[float] = None,
    min_members: Optional[int] = None,
    timeout: timedelta = timedelta(seconds=30),
    admission_timeout: float = 300.0,
    token: Optional[str] = None,
    backend: Optional[str] = None,
) -> tuple[ProcessGroup, Member]:
    """Create this worker's group, join the membership and wait to be admitted.

    Returns ``(pg, member)`` with ``pg`` configured on the member's configuration.
    The group's rendezvous uses the coordinator store; membership uses it too, or etcd
    when the launcher set ``$FTC10D_MEMBERSHIP_ENDPOINTS``. Under ``ftc10d launch`` the
    member goes through its node's agent (``$FTC10D_NODE_AGENT``): one member per node
    talks to the store.
    ``RANK``/``WORLD_SIZE`` only shape the *first* configuration (it waits for
    ``WORLD_SIZE`` members); ranks in later ones follow membership order.
    ``backend``: the group's channels (:mod:`ftc10d.pg.channels`); None: ``$FTC10D_BACKEND``,
    else ``cpu:gloo,cuda:nccl`` where CUDA and NCCL run, else ``gloo`` (as torch picks).
    """
    env = WorkerEnv.from_environ()
    hb = heartbeat_timeout if heartbeat_timeout is not None else env.heartbeat_timeout
    base = ReconnectingTCPStore(env.host, env.port, timeout=timeout)
    # The group holds the Python store itself: wrapped in a C++ PrefixStore only, the Python
    # object would be collected and torch's trampoline would fail every later call with
    # "Not implemented". The group's keys live under "ftc10d/cfg|init/", apart from membership's.
    backend = backend if backend is not None else default_backend()
    _check_cuda_device(backend)
    pg = ProcessGroup(base, env.rank, env.world_size, timeout=timeout, enable_reconfigure=True, backend=backend)
    handle = pg.get_reconfigure_handle()
    if env.launch_id:
        base.set(handle_key(env.launch_id, os.getpid()), handle)
    member = Member(
        env.membership_store(),
        handle,
        token=token if token is not None else os.environ.get(TOKEN_ENV),
        heartbeat_timeout=hb,
        min_members=min_members if min_members is not None else env.min_members,
        expected=env.world_size,
        node_agent=os.environ.get(NODE_AGENT_ENV) or None,
    ).join().attach(pg)
    cfg = member.sync(pg, timeout=admission_timeout)
    logger.info("worker %d: admitted at epoch %d as rank %d of %d", os.getpid(), cfg.epoch, pg.rank(), pg.size())
    if env.launch_id:
        _stop_job_on_uncaught()
    return pg, member


def _stop_job_on_uncaught() -> None:
    """Under ``ftc10d launch``: an uncaught StateLostError or ReplicaDivergenceError exits with
    ``EXIT_STOP_JOB`` after its traceback is printed, so that the launcher stops the job instead
    of respawning the worker into the same loss (each respawn would wait ``sync_timeout`` for a
    holder that is gone, or receive a diverged state). Any other exception keeps exit code 1."""
    previous = sys.excepthook

    def hook(kind: type, exc: BaseException, tb: Any) -> None:
        previous(kind, exc, tb)
        if isinstance(exc, (StateLostError, ReplicaDivergenceError)):
            sys.stdout.flush()
            sys.stderr.flush()
            logger.error("worker %d: %s: the job cannot go on; exiting %d so that the launcher stops it",
                         os.getpid(), kind.__name__, EXIT_STOP_JOB)
            os._exit(EXIT_STOP_JOB)

    if getattr(previous, "_ftc10d_stop_job", False):
        return
    hook._ftc10d_stop_job = True  # type: ignore[attr-defined]
    sys.excepthook = hook

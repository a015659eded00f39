"""Real etcd servers: one node, or a cluster on loopback (or across network namespaces
the caller made), for ``ftc10d chaos --membership etcd`` and the tests.

Kept in the package (not under ``tests/``) so that ``ftc10d chaos`` runs from an
installed package. Data lives on tmpfs unless ``base`` says otherwise, so Raft's
fsyncs are cheap on a 2-core CI machine. A member can be SIGKILLed (:meth:`EtcdCluster.kill`)
and started again on its own data dir (:meth:`EtcdCluster.restart`): it rejoins the
cluster as the same member. Every process started here is killed by ``stop()``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ftc10d.chaos.coordinator import free_port

logger = logging.getLogger("ftc10d")

#: The etcd binary on PATH (os.defpath, /bin:/usr/bin, when PATH is unset), so that PATH can hide it.
ETCD = shutil.which("etcd")
SKIP_REASON = "etcd is not installed (Debian: apt-get install etcd-server; `make test` installs it when run as root)"


@dataclass
class Node:
    name: str
    client_host: str
    client_port: int
    peer_host: str
    peer_port: int
    netns: Optional[str] = None
    extra_client_hosts: list[str] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    data_dir: str = ""

    @property
    def endpoint(self) -> str:
        return f"http://{self.client_host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.peer_host}:{self.peer_port}"


class EtcdCluster:
    """``n`` etcd nodes. ``hosts[i]`` is node i's address (default loopback);
    ``netns[i]`` runs node i inside that network namespace. ``base``: the folder of the
    data dirs and logs (created; removed by :meth:`stop`), a fresh one on tmpfs by default."""

    def __init__(self, n: int = 1, *, hosts: Optional[list[str]] = None, netns: Optional[dict[int, str]] = None,
                 extra_client_hosts: Optional[dict[int, list[str]]] = None, base: Optional[str] = None,
                 flags: Sequence[str] = ()) -> None:
        if ETCD is None:
            raise RuntimeError(SKIP_REASON)
        hosts = hosts or ["127.0.0.1"] * n
        netns = netns or {}
        self.flags = list(flags)  # more etcd flags, e.g. --max-request-bytes
        extra = extra_client_hosts or {}
        if base is None:
            base = tempfile.mkdtemp(prefix="ftc10d-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        else:
            os.makedirs(base, exist_ok=True)
        self.base = base
        self.pids: set[int] = set()  # every etcd process ever started (a trial's leak check)
        self.nodes: list[Node] = []
        for i in range(n):
            # Ports are picked in the root namespace; the loopback of a fresh namespace has them all free.
            self.nodes.append(Node(f"n{i}", hosts[i], free_port("127.0.0.1"), hosts[i], free_port("127.0.0.1"),
                                   netns.get(i), extra.get(i, [])))
        self.token = os.path.basename(self.base)

    @property
    def endpoints(self) -> list[str]:
        return [n.endpoint for n in self.nodes]

    @property
    def ports(self) -> list[int]:
        """Every client and peer port of the cluster (closed again after :meth:`stop`)."""
        return [p for n in self.nodes for p in (n.client_port, n.peer_port)]

    @property
    def _initial(self) -> str:
        return ",".join(f"{n.name}={n.peer_url}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        try:
            for node in self.nodes:
                self._spawn(node, self._initial, "new")
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, i: int) -> None:
        """Start node ``i`` again (after :meth:`kill`) on its own data dir: etcd reads its member
        id and the cluster from there (the ``--initial-*`` flags are ignored), so it rejoins as
        the same member and catches up from the leader. Returns at once; it is healthy later."""
        node = self.nodes[i]
        if node.proc is not None and node.proc.poll() is None:
            raise RuntimeError(f"etcd node {i} ({node.name}) is still running; kill() it first")
        self._spawn(node, self._initial, "new")
        logger.info("etcd node %s restarted on %s (pid %d)", node.name, node.data_dir, node.proc.pid)  # type: ignore

    def _spawn(self, node: Node, initial: str, state: str) -> None:
        node.data_dir = os.path.join(self.base, node.name)
        client_urls = ",".join(f"http://{h}:{node.client_port}" for h in [node.client_host] + node.extra_client_hosts)
        cmd = [
            ETCD, "--name", node.name, "--data-dir", node.data_dir,
            "--listen-client-urls", client_urls, "--advertise-client-urls", node.endpoint,
            "--listen-peer-urls", node.peer_url, "--initial-advertise-peer-urls", node.peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", state,
            "--initial-cluster-token", self.token,
            # Fast elections (and a 1 s minimum lease TTL) for tests on one machine.
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", "error", *self.flags,
        ]
        if node.netns:
            cmd = ["ip", "netns", "exec", node.netns] + cmd
        log = open(os.path.join(self.base, f"{node.name}.log"), "ab")
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.pids.add(node.proc.pid)

    def _healthy(self, node: Node) -> bool:
        if node.netns:
            out = subprocess.run(["ip", "netns", "exec", node.netns,
                                  "curl", "-s", "-m", "1", node.endpoint + "/health"],
                                 capture_output=True, text=True) if shutil.which("curl") else None
            if out is None:
                return node.proc is not None and node.proc.poll() is None
            return '"health":"true"' in out.stdout
        import requests  # the etcd extra's dependency: only needed once a cluster runs

        try:
            return requests.get(node.endpoint + "/health", timeout=1).json().get("health") == "true"
        except Exception:
            return False

    def healthy(self, i: int) -> bool:
        """Node ``i`` answers ``/health`` as healthy (it is up and the cluster has a leader)."""
        return self._healthy(self.nodes[i])

    def leader(self) -> Optional[int]:
        """The index of the Raft leader, as the first node that answers says; None if none answers
        (loopback nodes only). What a killed member was matters: a follower's loss costs nothing,
        a leader's costs an election (``--election-timeout``) during which no write commits."""
        import requests

        status: list[Optional[dict]] = []
        for node in self.nodes:
            try:
                status.append(requests.post(node.endpoint + "/v3/maintenance/status", json={}, timeout=1).json())
            except Exception:
                status.append(None)
        ids = [None if st is None else st.get("header", {}).get("member_id") for st in status]
        for st in status:
            if st is not None and st.get("leader") in ids:
                return ids.index(st["leader"])
        return None

    def wait_healthy(self, timeout: float = 30.0, nodes: Optional[list[int]] = None) -> None:
        deadline = time.monotonic() + timeout
        want = list(range(len(self.nodes))) if nodes is None else nodes
        while True:
            bad = [i for i in want if not self._healthy(self.nodes[i])]
            if not bad:
                return
            dead = [i for i in bad if self.nodes[i].proc is not None and self.nodes[i].proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(self.log(i)[-2000:] for i in bad)
                raise RuntimeError(f"etcd node(s) {bad} not healthy (exited: {dead}):\n{logs}")
            time.sleep(0.1)

    def log(self, i: int) -> str:
        try:
            with open(os.path.join(self.base, f"{self.nodes[i].name}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its process group) and reap it."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        """Kill every node and remove ``base`` (data dirs and logs). Idempotent."""
        for i in range(len(self.nodes)):
            try:
                self.kill(i)
            except Exception:
                pass
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""A partitioned minority does not form a configuration (a real network cut).

The test makes a network namespace joined to the root namespace by a veth pair,
puts 2 of 5 members in it (and, for etcd, 1 of the 3 etcd members), then takes
the link down. The majority side removes the minority and carries on; the
minority, which cannot reach the store (TCPStore) or the etcd quorum, forms no
configuration of its own; when the link comes back its members are fenced.
Everything made here (namespace, veth, processes) is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterator

import pytest

from ftc10d.membership import Agreement, Coordinator, Signer
from tests import harness
from ftc10d.chaos.etcd import ETCD, SKIP_REASON, EtcdCluster
from tests.membership.workers import member_worker, read_file_states

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 (ip netns) to make a network namespace",
)

MAJORITY = [0, 1, 2]
MINORITY = [3, 4]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Partition:
    """A namespace and a veth pair to it; ``cut()``/``heal()`` take the link down/up."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns = f"ftcm{tag}"
        self.root_if, self.ns_if = f"fm{tag}r", f"fm{tag}n"
        # Link-local addresses, on interfaces that exist only for this test.
        sub = tag % 250 + 1
        self.root_ip, self.ns_ip = f"169.254.{sub}.1", f"169.254.{sub}.2"

    def __enter__(self) -> "Partition":
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.ns)
            _ip("addr", "add", f"{self.root_ip}/30", "dev", self.root_if)
            _ip("link", "set", self.root_if, "up")
            _ip("-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            _ip("-n", self.ns, "link", "set", self.ns_if, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self) -> None:
        _ip("link", "set", self.root_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.root_if, "up")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def _wait(root: str, ranks: list[int], pred: Callable[[dict[int, dict[str, Any]]], bool], timeout: float,
          what: str) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    last: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        last = read_file_states(root, ranks)
        if len(last) == len(ranks) and pred(last):
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; states: {json.dumps(last, indent=1)}")


@pytest.fixture(params=["tcp", "etcd"])
def setup(request: Any) -> Iterator[tuple[Partition, dict[str, Any], dict[str, Any], Agreement]]:
    """(partition, majority's store spec, minority's store spec, an agreement to read the chain)."""
    with Partition() as part:
        if request.param == "tcp":
            co = Coordinator(part.root_ip, 0, detect=False).start()  # told to listen on the veth address
            spec = {"kind": "tcp", "host": part.root_ip, "port": co.port}
            try:
                yield part, spec, spec, co.agreement()
            finally:
                co.close()
        else:
            if ETCD is None:
                pytest.skip(SKIP_REASON)
            cluster = EtcdCluster(3, hosts=[part.root_ip, part.root_ip, part.ns_ip], netns={2: part.ns},
                                  extra_client_hosts={2: ["127.0.0.1"]})
            try:
                cluster.start()
                eps = cluster.endpoints
                prefix = f"/p{time.monotonic_ns()}/"
                major = {"kind": "etcd", "endpoints": eps, "prefix": prefix}
                minor = {"kind": "etcd", "endpoints": [eps[2], eps[0], eps[1]], "prefix": prefix}
                from ftc10d.membership import EtcdMembershipStore

                yield part, major, minor, Agreement(EtcdMembershipStore(eps[:2], prefix=prefix), Signer(None))
            finally:
                cluster.stop()


def test_partitioned_minority_forms_no_configuration(setup: tuple[Partition, dict, dict, Agreement]) -> None:
    part, major, minor, reader = setup
    root = tempfile.mkdtemp(prefix="ftc10d-partition-")
    opts = {"expected": 5, "state_dir": root, "netns": {str(r): part.ns for r in MINORITY}}
    majority = harness.start(member_worker, 3, major, opts)
    minority = harness.start(member_worker, 2, minor, {**opts, "rank_offset": 3, "netns": {"0": part.ns, "1": part.ns}},
                             store=majority.store)
    everyone = MAJORITY + MINORITY
    try:
        st = _wait(root, everyone, lambda s: len({v["uuid"] for v in s.values()} - {None}) == 1
                   and all(v["size"] == 5 for v in s.values()), 60, "5 members on one configuration")
        epoch = st[0]["epoch"]
        minority_handles = {st[r]["handle"] for r in MINORITY}
        majority_handles = {st[r]["handle"] for r in MAJORITY}
        part.cut()
        st = _wait(root, everyone, lambda s: all(s[r]["size"] == 3 and s[r]["epoch"] > epoch for r in MAJORITY), 30,
                   "the majority to remove the cut-off minority")
        new_epoch = st[0]["epoch"]
        assert not minority_handles & set(st[0]["handles"])
        time.sleep(3.0)  # three heartbeat timeouts on the minority side
        st = read_file_states(root, everyone)
        for r in MINORITY:
            assert st[r]["epoch"] == epoch and not st[r]["fenced"], st[r]
            assert st[r]["state"] in ("unreachable", "member"), st[r]
        # The store holds one chain, and every configuration after the cut is the majority's
        # (the two minority members may be dropped one epoch apart, as their watchers notice).
        chain = [reader.read_config(e) for e in range(epoch, reader.latest().epoch + 1)]
        assert all(c is not None for c in chain)
        for cfg in chain[1:]:
            assert majority_handles <= set(cfg.handles), cfg
        assert not minority_handles & set(chain[-1].handles)
        part.heal()
        _wait(root, everyone, lambda s: all(s[r]["fenced"] for r in MINORITY), 30,
              "the minority to find itself fenced once the link is back")
        assert read_file_states(root, MAJORITY)[0]["epoch"] >= new_epoch
        with open(os.path.join(root, "stop"), "w"):
            pass
        majority.collect(timeout=30)
        minority.collect(timeout=30)
    finally:
        with open(os.path.join(root, "stop"), "w"):
            pass
        majority.close()
        minority.close()
        shutil.rmtree(root, ignore_errors=True)

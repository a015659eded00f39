"""Hosts of a chaos trial as network namespaces joined by a bridge: a real link to cut.

Host 0 is the root namespace (it runs the coordinator); host ``i`` >= 1 is a
namespace ``ftcc<tag>h<i>`` with a veth pair whose root end is a port of one
bridge. Every host reaches every other through the bridge, and
:meth:`Hosts.cut` takes host ``i``'s bridge port down: its workers lose the
coordinator and every peer at once, as with a pulled cable (nothing is mocked:
packets stop). :meth:`Hosts.heal` brings the port back.

Workers of host ``i`` are started through a small wrapper (the launcher's
``python``) that execs ``ip netns exec <ns> python ...``: ``ip netns exec`` execs
in place, so the launcher's pid, pidfd and parent-death signal still name the
worker. ``GLOO_SOCKET_IFNAME`` points Gloo at the host's interface (the hostname
resolves to loopback, which does not cross namespaces).

Needs root and iproute2; :func:`available` says whether this machine can.
Everything made is removed by :meth:`Hosts.close` (also after a failure, and at
interpreter exit if something cut the trial's own cleanup short).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger("ftc10d")

_counter = 0
_CLONE_NEWNET = 0x40000000


def available() -> tuple[bool, str]:
    """(True, "") if network namespaces can be made here, else (False, why not)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return False, "needs iproute2 (the ip command)"
    return True, ""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _free_subnet(first: int) -> int:
    """The first of the 169.254.<n>.64/26 subnets from ``first`` on that no interface of
    the root namespace has: a bridge left by a run killed hard (SIGKILL, a power cut) has
    one, and a second route to the same subnet sends the trial's packets nowhere (the
    workers of its other hosts never reach the coordinator)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    used = {int(part.split(".")[2]) for part in out.split() if part.startswith("169.254.")}
    for k in range(250):
        n = (first - 1 + k) % 250 + 1
        if n not in used:
            return n
    raise RuntimeError("every 169.254.<n>.64/26 subnet is taken: remove the fcb* bridges left by killed chaos runs "
                       "(ip link del <name>)")


class Hosts:
    """``count`` hosts (1 = the root namespace alone: nothing is made)."""

    def __init__(self, count: int) -> None:
        global _counter
        _counter += 1
        tag = (os.getpid() * 7 + _counter) % 100000
        self.count = count
        self.bridge = f"fcb{tag}"
        self.subnet = (tag % 250) + 1
        self.ns = {i: f"ftcc{tag}h{i}" for i in range(1, count)}
        self.root_if = {i: f"fc{tag}r{i}" for i in range(1, count)}
        self.ns_if = {i: f"fc{tag}n{i}" for i in range(1, count)}
        self.cut_hosts: set[int] = set()
        self._made = False

    def ip_of(self, host: int) -> str:
        """Host ``host``'s address (host 0: the bridge's, where the coordinator listens)."""
        return f"169.254.{self.subnet}.{65 + host}"

    def ifname_of(self, host: int) -> str:
        return self.bridge if host == 0 else self.ns_if[host]

    def start(self) -> "Hosts":
        if self.count <= 1:
            return self
        self.subnet = _free_subnet(self.subnet)
        self._made = True
        atexit.register(self.close)  # whatever cuts the trial's cleanup short must not leak them
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.ip_of(0)}/26", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(1, self.count):
                _ip("netns", "add", self.ns[i])
                _ip("link", "add", self.root_if[i], "type", "veth", "peer", "name", self.ns_if[i])
                _ip("link", "set", self.ns_if[i], "netns", self.ns[i])
                _ip("link", "set", self.root_if[i], "master", self.bridge)
                _ip("link", "set", self.root_if[i], "up")
                _ip("-n", self.ns[i], "addr", "add", f"{self.ip_of(i)}/26", "dev", self.ns_if[i])
                _ip("-n", self.ns[i], "link", "set", self.ns_if[i], "up")
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def python_for(self, host: int, folder: Path) -> str:
        """The interpreter the launcher of ``host`` runs: this Python, inside the host's namespace."""
        if host == 0:
            return sys.executable
        path = folder / f"python-host{host}.sh"
        path.write_text(f"#!/bin/sh\nexec ip netns exec {self.ns[host]} {sys.executable} \"$@\"\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return str(path)

    def thread_entry(self, host: int) -> Optional[Callable[[], None]]:
        """A function that moves the *calling thread* into host ``host``'s network namespace
        (``setns`` is per thread): the launcher's node agent of that host speaks for workers
        that live there, and must be cut off with them. None for host 0 (the root namespace)."""
        if host == 0:
            return None
        path = f"/var/run/netns/{self.ns[host]}"

        def enter() -> None:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({path}) failed")
            finally:
                os.close(fd)

        return enter

    def cut(self, host: int) -> None:
        """Take host ``host``'s link down: a real partition of its workers from everyone else."""
        _ip("link", "set", self.root_if[host], "down")
        self.cut_hosts.add(host)

    def heal(self, host: int) -> None:
        _ip("link", "set", self.root_if[host], "up")
        self.cut_hosts.discard(host)

    def close(self) -> None:
        if not self._made:
            return
        for i in range(1, self.count):
            subprocess.run(["ip", "link", "del", self.root_if[i]], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", self.ns[i]], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        self._made = False
        atexit.unregister(self.close)  # last: until all is removed, exit still removes it

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

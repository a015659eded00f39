"""Membership: detection-to-agreement after a failure (4 real members).

Part 1, **detection to agreement** (4 real members, each its own process with a
real ``ftc10d.ProcessGroup``): the time from a failure to *every survivor
holding* the next configuration (its ``Member`` adopted it; times are
``time.monotonic()``, one clock for every process on the host). Three ways to
learn of the failure, fastest first:

- ``exit reported``: the rank is SIGKILLed; the parent, playing the supervisor,
  sees the process exit and calls ``report_exit(handle)``. From the kill.
- ``peer error``: the ranks allreduce in a loop; the rank is SIGKILLed; the
  survivors' ``PeerFailureError`` (via ``pg.add_error_listener``) is the report.
  From the kill.
- ``frozen``: the rank is SIGSTOPped; its heartbeat lapses (timeout 1 s). From
  the stop. Target: heartbeat timeout + 50 ms.

Each trial starts 4 fresh members (a new key prefix), so trials do not interact.

The scale part that was here (simulated members heartbeating, blocking watchers) no
longer modelled what members do; per-node membership at scale is
``benchmarks/membership_scale.py`` (real node agents), the store's load per rank and
per node ``benchmarks/membership_load.py``.

    python benchmarks/membership.py [--trials 10] [--no-etcd] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    client_store, die_with_parent, dump_json, host_store, machine, median, percentile, start, table)

HB_TIMEOUT = 1.0
TARGET_FAST_MS = 50.0
TARGET_FROZEN_MS = HB_TIMEOUT * 1000 + 50.0
TARGET_SCALE_MS = 200.0
SCENARIOS = ("exit reported", "peer error", "frozen")


# ======================================================================== stores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One etcd node on loopback with its data on tmpfs (the benchmark's, killed at the end)."""

    def __init__(self) -> None:
        self.exe = shutil.which("etcd")
        self.dir = tempfile.mkdtemp(prefix="ftc10d-bench-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.port, peer = _free_port(), _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        assert self.exe is not None
        self.proc = subprocess.Popen(
            [self.exe, "--name", "b0", "--data-dir", os.path.join(self.dir, "d"),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"b0=http://127.0.0.1:{peer}", "--heartbeat-interval", "50",
             "--election-timeout", "500", "--logger", "zap", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent)
        import requests

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.endpoint + "/health", timeout=1).json().get("health") == "true":
                    return
            except Exception:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _make_store(spec: dict[str, Any]) -> Any:
    from ftc10d.membership import EtcdMembershipStore, TCPMembershipStore

    if spec["kind"] == "tcp":
        return TCPMembershipStore(spec["host"], spec["port"], prefix=spec["prefix"])
    return EtcdMembershipStore(spec["endpoints"], prefix=spec["prefix"])


# ================================================================ part 1: worker


def member_worker(rank: int, world: int, port: int, spec: dict[str, Any], allreduce: bool) -> None:
    """A rank: ProcessGroup + Member; records when it holds each new configuration."""
    import torch

    import ftc10d
    from ftc10d.membership import Member

    control = client_store(port)
    tag = spec["prefix"]
    pg = ftc10d.ProcessGroup(dist.PrefixStore(f"pg{tag}", client_store(port)), rank, world,
                             timeout=timedelta(seconds=30), enable_reconfigure=True)
    member = Member(_make_store(spec), pg.get_reconfigure_handle(), heartbeat_timeout=HB_TIMEOUT, expected=world)
    member.join().attach(pg)
    cfg = member.sync(pg, timeout=60)
    control.set(f"{tag}/ready/{rank}", json.dumps({"handle": pg.get_reconfigure_handle(), "epoch": cfg.epoch}))

    def record() -> None:
        last = cfg.epoch
        while True:
            try:
                nxt = member.wait_next(last)
            except ftc10d.MembershipError:
                return
            control.set(f"{tag}/hold/{rank}/{nxt.epoch}", repr(time.monotonic()))
            last = nxt.epoch

    threading.Thread(target=record, daemon=True).start()
    t = torch.ones(256)
    while not control.check([f"{tag}/stop"]):
        if not allreduce:
            time.sleep(0.02)
            continue
        try:
            if member.current().uuid != pg.uuid:
                member.sync(pg, timeout=30)
            dist.all_reduce(t, group=pg)
        except ftc10d.Fenced:
            return
        except ftc10d.CollectiveError:
            if control.check([f"{tag}/stop"]):
                break
            try:
                member.sync(pg, timeout=30)
            except ftc10d.MembershipError:
                return
        time.sleep(0.005)
    member.close()


def _wait_keys(store: dist.TCPStore, keys: list[str], timeout: float, job: Any = None) -> list[bytes]:
    """Wait for ``keys``; with ``job``, fail as soon as one of its processes died (with its error)."""
    deadline = time.monotonic() + timeout
    while job is not None and not store.check(keys):
        dead = [p for p in job.procs if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            try:
                job.collect(timeout=2)
            except Exception as exc:
                raise RuntimeError(f"a benchmark process failed: {exc}") from exc
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"timed out waiting for {len(missing)} of {len(keys)} keys: {missing[:4]}...")
        time.sleep(0.05)
    store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 1)))
    return list(store.multi_get(keys))


def detection_trial(spec: dict[str, Any], scenario: str, control: dist.TCPStore) -> float:
    """One trial: 4 fresh members, one failure, ms until every survivor holds the next configuration."""
    from ftc10d.membership import Agreement, Signer

    world, victim = 4, 3
    tag = spec["prefix"]
    job = start(member_worker, world, spec, scenario == "peer error", store=control)
    try:
        ready = [json.loads(v) for v in _wait_keys(control, [f"{tag}/ready/{r}" for r in range(world)], 120)]
        epoch = ready[0]["epoch"]
        assert all(r["epoch"] == epoch for r in ready), ready
        time.sleep(HB_TIMEOUT * 1.5)  # steady state: every detector has a full timeout of heartbeats
        supervisor = Agreement(_make_store(spec), Signer(None))  # a launcher holds its connection
        supervisor.latest()
        proc = job.procs[victim]
        if scenario == "frozen":
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGSTOP)
        else:
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            if scenario == "exit reported":
                proc.join()  # the supervisor sees the exit (waitpid), then reports it
                supervisor.report_exit(ready[victim]["handle"])
        holds = _wait_keys(control, [f"{tag}/hold/{r}/{epoch + 1}" for r in range(world) if r != victim], 30)
        took = (max(float(v) for v in holds) - t0) * 1000
        control.set(f"{tag}/stop", "1")
        return took
    finally:
        job.close()


# ================================================================= part 2: scale


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_coordinator(port: int, detect: bool, timeout: float = HB_TIMEOUT) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ftc10d", "coordinator", "--port", str(port), "--heartbeat-timeout", str(timeout)]
    if not detect:
        cmd.append("--no-detect")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("coordinator did not start")


# ========================================================================== main


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per scenario and backend")
    ap.add_argument("--no-etcd", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    started = time.time()
    from ftc10d.membership import Coordinator

    results: dict[str, Any] = {"detection": {}}
    backends = [] if args.trials <= 0 else ["tcp"] + ([] if args.no_etcd or shutil.which("etcd") is None else ["etcd"])
    rows = []
    for backend in backends:
        co = Coordinator(detect=False).start() if backend == "tcp" else None
        etcd = Etcd() if backend == "etcd" else None
        control = host_store()
        try:
            for scenario in SCENARIOS:
                samples = []
                for i in range(args.trials):
                    prefix = f"b{secrets.token_hex(4)}/"
                    if co is not None:
                        spec = {"kind": "tcp", "host": co.host, "port": co.port, "prefix": prefix}
                    else:
                        spec = {"kind": "etcd", "endpoints": [etcd.endpoint], "prefix": "/" + prefix}
                    samples.append(detection_trial(spec, scenario, control))
                results["detection"][f"{backend}/{scenario}"] = samples
                target = TARGET_FROZEN_MS if scenario == "frozen" else TARGET_FAST_MS
                p50 = median(samples)
                rows.append([backend, scenario, len(samples), f"{p50:.1f}", f"{percentile(samples, 90):.1f}",
                             f"{max(samples):.1f}", f"<= {target:.0f} ms", "met" if p50 <= target else "MISSED"])
                print(f"  {backend} {scenario}: p50 {p50:.1f} ms", file=sys.stderr, flush=True)
        finally:
            if co is not None:
                co.close()
            if etcd is not None:
                etcd.stop()
    if rows:
        print(f"membership detection-to-agreement: 4 members (real processes, real ProcessGroups), heartbeat timeout "
          f"{HB_TIMEOUT:g} s; time from the failure to every survivor holding the next configuration; "
          f"{machine()}")
        print(table(["backend", "failure seen through", "trials", "p50 ms", "p90 ms", "max ms", "target (p50)",
                     "verdict"], rows))
    print(f"({time.time() - started:.0f} s)")
    dump_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

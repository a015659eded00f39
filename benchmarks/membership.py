"""Membership: detection-to-agreement after a failure, and the coordinator at scale.

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

Part 2, **scale**: ``ftc10d coordinator`` (the real CLI, in its own process)
with 1,024 and 4,096 simulated members in a few processes. Each member is a
``mem/<id>`` record, a join and a heartbeat ``set`` 10 times a second (its own
request: 4,096 members are 41k requests/s at the store). Members learn new
configurations through watch connections, one per ``--members-per-watch``
members (8: a node agent per 8 ranks; see docs/architecture.md on per-node
aggregation). Reported: the store process's CPU while they heartbeat (with its
detector off, then on), the heartbeat rate actually achieved, and the time from
one failure (an exit reported, or a member that stops beating) to every watch
holding the next configuration.

    python benchmarks/membership.py [--trials 10] [--scale 1024,4096] [--no-etcd] [--json out.json]
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

from benchmarks._common import client_store, dump_json, host_store, machine, median, percentile, start, table  # noqa: E402

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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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


def sim_process(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """``opts["n"]`` simulated members: records, joins, heartbeats at 10 Hz, and watchers."""
    from ftc10d import StoreUnavailableError
    from ftc10d.membership import Agreement, MemberInfo, Signer
    from ftc10d.membership.agreement import hb_key, mem_key

    rank += opts.get("rank_base", 0)  # the probe process reports under its own rank
    control = client_store(port)
    store = _make_store(spec)
    signer = Signer(None)
    n = opts["n"]
    ids = [f"s{rank:02d}{i:05d}{secrets.token_hex(3)}" for i in range(n)]
    for i, mid in enumerate(ids):
        info = MemberInfo(id=mid, handle=f"ftc10d/v1/sim{rank}/{i}/{secrets.token_hex(8)}")
        store.put(mem_key(mid), signer.encode(mem_key(mid), info.to_body()))
        store.put(hb_key(mid), signer.encode_beat(hb_key(mid), 1))
        store.append_join(mid)
    control.set(f"sim/joined/{rank}", json.dumps(ids))
    frozen: set[str] = set()
    stop = threading.Event()
    beats = [0]
    lock = threading.Lock()

    def beater(share: list[str]) -> None:
        st = store.clone()
        counter = 1
        period = 1.0 / opts["hz"]
        nxt = time.monotonic()
        while not stop.is_set():
            counter += 1
            done = 0
            for mid in share:
                if mid not in frozen:
                    key = hb_key(mid)
                    try:
                        st.put(key, signer.encode_beat(key, counter))
                    except StoreUnavailableError:
                        continue  # a (re)connect stalled: the member misses one beat
                    done += 1
            with lock:
                beats[0] += done
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            elif delay < -period:
                nxt = time.monotonic()

    def watcher(w: int) -> None:
        st = store.clone()
        ag = Agreement(st, signer)
        cur = None
        while not stop.is_set():
            try:
                if cur is None:
                    st.wait_for("start", 5.0)  # server-pushed: no polling while the others join
                    cur = ag.latest()
                    if cur is None:
                        continue
                    control.set(f"sim/hold/{rank}/{w}/{cur.epoch}", repr(time.monotonic()))
                ag.remember(cur)
                raw = st.wait_for(f"cfg/{cur.epoch + 1:012d}", 5.0)
            except StoreUnavailableError:
                continue
            if raw is None:
                continue
            nxt = ag.read_config(cur.epoch + 1, raw=raw)
            if nxt is None:
                continue
            cur = nxt
            control.set(f"sim/hold/{rank}/{w}/{cur.epoch}", repr(time.monotonic()))

    shares = [ids[i::opts["beat_threads"]] for i in range(opts["beat_threads"])]
    threads = [threading.Thread(target=beater, args=(s,), daemon=True) for s in shares]
    watches = max(1, n // opts["per_watch"])
    threads += [threading.Thread(target=watcher, args=(w,), daemon=True) for w in range(watches)]
    for t in threads:
        t.start()
    control.set(f"sim/watches/{rank}", str(watches))
    seen = 0
    while not control.check(["sim/stop"]):
        key = f"sim/freeze/{seen}"
        if control.check([key]):
            frozen.add(control.get(key).decode())
            seen += 1
        with lock:
            control.set(f"sim/beats/{rank}", str(beats[0]))
        time.sleep(0.02)
    stop.set()
    return {"beats": beats[0]}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_coordinator(port: int, detect: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ftc10d", "coordinator", "--port", str(port), "--heartbeat-timeout", str(HB_TIMEOUT)]
    if not detect:
        cmd.append("--no-detect")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("coordinator did not start")


def scale_run(n_members: int, procs: int, detect: bool, window: float, per_watch: int) -> dict[str, Any]:
    """One coordinator, ``n_members`` simulated members; CPU over ``window`` s, then failures."""
    from ftc10d.membership import Agreement, Signer

    port = _free_port()
    coord = _start_coordinator(port, detect)
    control = host_store()
    spec = {"kind": "tcp", "host": "127.0.0.1", "port": port, "prefix": "ftc10d/membership/"}
    opts = {"n": n_members // procs, "hz": 10.0, "beat_threads": 2, "per_watch": per_watch}
    job = start(sim_process, procs, spec, opts, store=control)
    # A probe: one watcher in a process of its own, with no simulated members to serve. Its
    # latency is the coordinator's (agreement + server push + one read of the configuration);
    # the loaded simulator processes add their own queueing (a Python process serving
    # 1,000 members' heartbeats and watches contends for its GIL).
    probe = start(sim_process, 1, spec, {**opts, "n": 0, "rank_base": procs}, store=control)
    out: dict[str, Any] = {"members": n_members, "detect": detect}
    try:
        ids = [json.loads(v) for v in _wait_keys(control, [f"sim/joined/{r}" for r in range(procs)], 300, job)]
        watches = [int(v) for v in _wait_keys(control, [f"sim/watches/{r}" for r in range(procs)], 60, job)]
        ag = Agreement(_make_store(spec), Signer(None), expected=n_members, require_majority=True)
        t = time.monotonic()
        first = ag.propose(reason="benchmark: all joined")
        assert first.config is not None and first.config.size == n_members, first
        out["form_ms"] = (time.monotonic() - t) * 1000
        hold_keys = lambda e: [f"sim/hold/{r}/{w}/{e}" for r in range(procs) for w in range(watches[r])]  # noqa: E731
        probe_key = lambda e: [f"sim/hold/{procs}/0/{e}"]  # noqa: E731
        _wait_keys(control, hold_keys(first.config.epoch), 120, job)
        _wait_keys(control, probe_key(first.config.epoch), 60, probe)
        time.sleep(2.0)  # settle
        b0 = sum(int(v) for v in _wait_keys(control, [f"sim/beats/{r}" for r in range(procs)], 10))
        c0, t0 = _cpu_seconds(coord.pid), time.monotonic()
        sims0 = sum(_cpu_seconds(p.pid) for p in job.procs)
        time.sleep(window)
        c1, t1 = _cpu_seconds(coord.pid), time.monotonic()
        sims1 = sum(_cpu_seconds(p.pid) for p in job.procs)
        b1 = sum(int(v) for v in _wait_keys(control, [f"sim/beats/{r}" for r in range(procs)], 10))
        out["store_cpu_pct"] = (c1 - c0) / (t1 - t0) * 100
        out["sims_cpu_pct"] = (sims1 - sims0) / (t1 - t0) * 100
        out["beats_per_s"] = (b1 - b0) / (t1 - t0)
        out["watches"] = sum(watches)
        # One failure, reported (a supervisor saw the exit): report -> every watch holds the next epoch.
        epoch = first.config.epoch
        victim = ids[0][0]
        control.set("sim/freeze/0", victim)
        handle = first.config.handle_of(victim)
        t = time.monotonic()
        rep = ag.report_exit(handle)
        out["agree_ms"] = (time.monotonic() - t) * 1000  # the next configuration is in the store
        assert rep.changed, rep
        out["probe_ms"] = (float(_wait_keys(control, probe_key(epoch + 1), 60, probe)[0]) - t) * 1000
        holds = _wait_keys(control, hold_keys(epoch + 1), 60, job)
        out["report_to_all_ms"] = (max(float(v) for v in holds) - t) * 1000
        if detect:
            # One member stops beating: lapse (timeout) -> the coordinator's detector -> all hold.
            victim2 = ids[-1][-1]
            t = time.monotonic()
            control.set("sim/freeze/1", victim2)
            holds = _wait_keys(control, hold_keys(epoch + 2), 60, job)
            out["frozen_to_all_ms"] = (max(float(v) for v in holds) - t) * 1000
        control.set("sim/stop", "1")
        job.collect(timeout=60)
        probe.collect(timeout=60)
    finally:
        job.close()
        probe.close()
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait(10)
    return out


# ========================================================================== main


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per scenario and backend")
    ap.add_argument("--scale", default="1024,4096", help="simulated member counts ('' to skip)")
    ap.add_argument("--scale-procs", type=int, default=4)
    ap.add_argument("--members-per-watch", type=int, default=8)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of CPU measurement")
    ap.add_argument("--no-etcd", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    started = time.time()
    from ftc10d.membership import Coordinator

    results: dict[str, Any] = {"detection": {}, "scale": []}
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
    scale_rows = []
    for n in [int(x) for x in args.scale.split(",") if x]:
        for detect in (False, True):
            r = scale_run(n, args.scale_procs, detect, args.window, args.members_per_watch)
            results["scale"].append(r)
            print(f"  scale {n} detect={detect}: {r}", file=sys.stderr, flush=True)
            scale_rows.append([
                n, "on" if detect else "off", f"{r['beats_per_s']:.0f}", f"{r['store_cpu_pct']:.0f}%",
                f"{r['sims_cpu_pct']:.0f}%", r["watches"], f"{r['agree_ms']:.1f}", f"{r['probe_ms']:.1f}",
                f"{r['report_to_all_ms']:.1f}",
                f"{r['frozen_to_all_ms']:.0f}" if "frozen_to_all_ms" in r else "-",
                f"<= {TARGET_SCALE_MS:.0f} ms" if n >= 4096 else "-",
                ("met" if r["probe_ms"] <= TARGET_SCALE_MS else "MISSED") if n >= 4096 else "-",
            ])
    if scale_rows:
        print()
        print(f"membership scale: `ftc10d coordinator` process, simulated members heartbeating at 10 Hz from "
              f"{args.scale_procs} processes, one watch per {args.members_per_watch} members; CPU over "
              f"{args.window:g} s; {machine()}")
        print(table(["members", "detector", "beats/s", "store CPU", "sim procs CPU", "watches", "report -> agreed ms",
                     "report -> probe holds ms", "report -> all sim watches hold ms", "stop beating -> all hold ms",
                     "target (probe)", "verdict"],
                    scale_rows))
    print(f"({time.time() - started:.0f} s)")
    dump_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One chaos trial: launch the job, inject its schedule, then check everything.

The job runs through :class:`ftc10d.launch.Launcher` exactly as under ``ftc10d
launch`` (one launcher per host; host 0's hosts the coordinator), with warm
spares. Faults are injected from this process: signals to a slot's worker pid
(``Launcher.kill``), the job's ``die`` option armed at launch, a link of a network
namespace taken down, a member of the trial's own etcd cluster SIGKILLed and restarted
(``--membership etcd``: each trial starts three on loopback, data dirs in its folder).
The driver loop is a single thread ticking every 10 ms: it tails the workers' event
files for the job's progress and fires each fault when its step is committed, plus the
timed halves (SIGCONT, duty cycles, heal, etcd restart).

After the job, whatever happened: every stopped process is resumed, links are
restored, launchers closed, the etcd cluster (after a check that a restarted member
rejoined it) stopped; then :mod:`ftc10d.chaos.checks` judges the event
files, the membership chain and the machine (leftover processes, /dev/shm,
ports). A trial is *survived* when it has no violation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ftc10d.chaos import checks
from ftc10d.chaos.coordinator import CoordinatorProcess
from ftc10d.chaos.etcd import EtcdCluster
from ftc10d.chaos.netns import Hosts
from ftc10d.chaos.schedule import ETCD_MEMBERS, STALE_GAP, STORE_KINDS, Fault, TrialSpec, hosts_of
from ftc10d.demo.driver import Tail  # new complete JSON lines of a folder's *.jsonl, as the demo tails them

logger = logging.getLogger("ftc10d")

JOB = str(Path(__file__).with_name("job.py"))
TICK_S = 0.01
#: Slow rank: one SIGSTOP/SIGCONT period and the stopped fraction of it.
SLOW_PERIOD_S, SLOW_STOPPED = 0.1, 0.5
#: A fault whose slot has no live worker (being replaced) waits this long, then is skipped.
RETARGET_S = 15.0
#: ``--mesh``: a worker that committed within this many seconds trains (steps take ~0.1 s).
WHOLE_S = 1.0
#: Never a configuration of fewer (a lone worker cut off, or left behind, must not train on alone).
MIN_MEMBERS = 2
#: The Manager's sync_timeout in a trial with a ``stale`` fault (how long the job waits for a holder of
#: its lost state before StateLostError).
STALE_SYNC_S = 8.0
#: ... and in the others. Deaths the schedule did not plan as a loss can still take every holder of
#: the newest state (a double kill beside an armed ``die_send``): the job then waits this long and
#: stops (exit 86), well inside the trial's timeout (it was 120 s, the trial's own timeout: such a
#: trial hung instead of showing the stop).
SYNC_S = 30.0


@dataclass
class Injected:
    """A fault as it happened: when, on which pids, when it ended, and the stall it caused."""

    fault: Fault
    t_fault: Optional[float] = None
    t_end: Optional[float] = None
    pids: list[int] = field(default_factory=list)
    skipped: Optional[str] = None
    stall_s: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault.to_json(), "desc": str(self.fault), "t_fault": self.t_fault, "t_end": self.t_end,
                "pids": self.pids, "skipped": self.skipped, "stall_s": self.stall_s}


@dataclass
class TrialResult:
    spec: TrialSpec
    violations: list[str]
    injected: list[Injected]
    duration_s: float
    returncode: Optional[int]
    notes: list[str] = field(default_factory=list)
    folder: str = ""
    coverage: dict[str, int] = field(default_factory=dict)
    #: The job's longest interval between consecutive commits, whatever its cause (None: < 2 commits).
    longest_pause_s: Optional[float] = None
    #: The bound it was checked against (``checks.pause_bound``); above it is a violation.
    pause_bound_s: Optional[float] = None

    @property
    def survived(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.spec.seed, "schedule": self.spec.describe(), "spec": self.spec.to_json(),
                "survived": self.survived, "violations": self.violations,
                "faults": [i.to_json() for i in self.injected], "duration_s": round(self.duration_s, 3),
                "returncode": self.returncode, "notes": self.notes, "folder": self.folder,
                "coverage": self.coverage, "longest_pause_s": self.longest_pause_s,
                "pause_bound_s": self.pause_bound_s}


class Trial:
    """Runs one :class:`TrialSpec` in ``folder``; :meth:`run` returns the :class:`TrialResult`."""

    def __init__(self, spec: TrialSpec, folder: Path, say: Callable[[str], None] = lambda s: None) -> None:
        self.spec = spec
        self.folder = Path(folder)
        self.say = say
        self.events_dir = self.folder / "events"
        self.trial_id = f"{spec.seed}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.host_of = hosts_of(spec.world_size, spec.hosts)
        self.launchers: list[Any] = []
        self.launch_events: list[Any] = []
        self.pids: set[int] = set()
        self.stopped: set[int] = set()
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.net = Hosts(spec.hosts)
        self.coord: Optional[CoordinatorProcess] = None
        self.etcd: Optional[EtcdCluster] = None
        self.notes: list[str] = []
        self.killed: set[int] = set()
        self.t_close = float("inf")
        #: pid -> when it last committed (``--mesh``: a fault waits until every slot trains).
        self.last_commit: dict[int, float] = {}
        #: ``stale``: (the fault, the frozen pid, the job step at which the holders are killed).
        self.stale: Optional[tuple[Injected, int, int]] = None
        #: When a ``stale`` fault killed the holders of the job's newest state (the job must stop).
        self.lost_at: Optional[float] = None

    # ------------------------------------------------------------ launching

    def _die_opts(self) -> dict[str, Any]:
        die: dict[str, Any] = {}
        for f in self.spec.faults:
            if f.kind in ("die_vote", "die_after_vote"):
                die[str(f.slot)] = {"op": "vote" if f.kind == "die_vote" else "after_vote", "after_step": f.at_step,
                                    "gated": self.spec.mesh is not None}
            elif f.kind == "die_send":
                for s in range(self.spec.world_size):
                    if s != f.slot and str(s) not in die:
                        die[str(s)] = {"op": "send", "after_step": f.at_step}
        return die

    def _launch(self) -> None:
        from ftc10d.launch import LaunchConfig, Launcher

        src = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
        die = self._die_opts()
        address: Optional[str] = None
        if any(f.kind in STORE_KINDS for f in self.spec.faults):
            self.coord = CoordinatorProcess(self.net.ip_of(0) if self.spec.hosts > 1 else "127.0.0.1",
                                            self.spec.heartbeat_timeout, {"PYTHONPATH": pythonpath})
            self.coord.start()
            address = self.coord.address
        endpoints: Optional[list[str]] = None
        if self.spec.membership == "etcd":
            self.etcd = EtcdCluster(ETCD_MEMBERS, base=str(self.folder / "etcd"))
            self.etcd.start()
            endpoints = self.etcd.endpoints
        for host in range(self.spec.hosts):
            slots = [s for s, h in enumerate(self.host_of) if h == host]
            opts = {"out": str(self.folder), "trial": self.trial_id, "steps": self.spec.steps,
                    "interval": self.spec.interval, "world": self.spec.world_size, "rank_base": slots[0], "die": die,
                    "min_members": MIN_MEMBERS, "mesh": self.spec.mesh,
                    "sync_timeout": STALE_SYNC_S if any(f.kind == "stale" for f in self.spec.faults) else SYNC_S}
            env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "FTC10D_CHAOS_OPTS": json.dumps(opts),
                   "FTC10D_FLIGHT_RECORDER": "0"}
            if self.spec.hosts > 1:
                env["GLOO_SOCKET_IFNAME"] = self.net.ifname_of(host)
            cfg = LaunchConfig(
                script=JOB, nproc_per_node=len(slots), spares=self.spec.spares if host == 0 else 0,
                max_restarts=10, coordinator=address, membership_endpoints=endpoints,
                host=self.net.ip_of(0) if self.spec.hosts > 1 else "127.0.0.1",
                heartbeat_timeout=self.spec.heartbeat_timeout, min_members=min(MIN_MEMBERS, len(slots)), env=env,
                log_dir=str(self.folder / "logs" / f"host{host}"), python=self.net.python_for(host, self.folder),
            )
            launcher = Launcher(cfg, on_event=self._on_launch_event, agent_thread_init=self.net.thread_entry(host))
            launcher.start()
            self.launchers.append(launcher)
            address = launcher.coordinator_address if address is None else address

    def _on_launch_event(self, ev: Any) -> None:  # on a launcher's supervisor thread
        self.launch_events.append(ev)
        if ev.pid is not None:
            self.pids.add(ev.pid)

    def _where(self, slot: int) -> tuple[Any, int]:
        host = self.host_of[slot]
        first = self.host_of.index(host)
        return self.launchers[host], slot - first

    def _pid(self, slot: int) -> Optional[int]:
        launcher, local = self._where(slot)
        return launcher.pids().get(local)

    def _signal(self, slot: int, sig: int) -> int:
        launcher, local = self._where(slot)
        pid = launcher.kill(local, sig)
        self.pids.add(pid)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGKILL:
            self.killed.add(pid)
        return pid

    def _cont(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.stopped.discard(pid)

    # ------------------------------------------------------------ faults

    def _inject(self, inj: Injected) -> bool:
        """Fire ``inj``'s fault now if its target is there; False to try again next tick."""
        f, now = inj.fault, time.time()
        targets = [f.slot, f.slot2] if f.kind == "double" else self._replica_slots(f.slot) if f.kind == "node" \
            else [] if f.kind in ("partition", "die_vote", "die_after_vote", "etcd", *STORE_KINDS) else [f.slot]
        if any(self._pid(s) is None for s in targets if s is not None):
            return False
        if self.spec.mesh is not None and not self._mesh_whole(now):
            return False
        if f.kind == "etcd" and not self._etcd_whole(f.slot):
            return False  # one of three at a time: a second one down would take the quorum away
        inj.t_fault = now
        hb = self.spec.heartbeat_timeout
        if f.kind in ("kill", "die_send"):
            inj.pids = [self._signal(f.slot, signal.SIGKILL)]
            inj.t_end = now
        elif f.kind == "node":
            inj.pids = [self._signal(s, signal.SIGKILL) for s in targets]
            inj.t_end = time.time()
        elif f.kind == "stale":  # the holders are killed once the others went on: _kill_holders
            pid = self._signal(f.slot, signal.SIGSTOP)
            inj.pids = [pid]
            self.stale = (inj, pid, self.job_step + STALE_GAP)
        elif f.kind in ("stop_short", "stop_long"):
            pid = self._signal(f.slot, signal.SIGSTOP)
            inj.pids = [pid]
            self._at(now + (f.duration or hb), lambda: self._resume(inj, pid))
        elif f.kind == "slow":
            pid = self._signal(f.slot, signal.SIGSTOP)
            inj.pids = [pid]
            self._duty_cycle(inj, pid, now, now + (f.duration or 2.0))
        elif f.kind == "double":
            inj.pids = [self._signal(f.slot, signal.SIGKILL)]
            if f.gap_s:
                time.sleep(f.gap_s)
            second = self._signal(f.slot2, signal.SIGKILL if f.kind2 == "kill" else signal.SIGSTOP)  # type: ignore
            inj.pids.append(second)
            if f.kind2 == "kill":
                inj.t_end = time.time()
            else:
                self._at(now + (f.duration or 2 * hb), lambda: self._resume(inj, second))
        elif f.kind == "store":
            assert self.coord is not None
            self.coord.kill()
            self._at(now + (f.duration or 1.0), lambda: self._restart_store(inj))
        elif f.kind == "store_stop":
            assert self.coord is not None
            pid = self.coord.freeze()
            if pid is None:
                return False  # the store is down (a store fault's restart is due): next tick again
            inj.pids = [pid]
            self._at(now + (f.duration or 1.0), lambda: self._thaw_store(inj))
        elif f.kind == "etcd":
            assert self.etcd is not None
            node = self.etcd.nodes[f.slot]
            leader = self.etcd.leader()
            self.notes.append(f"{f}: etcd member {f.slot} was "
                              + ("the leader" if leader == f.slot else "unknown (no status)" if leader is None
                                 else f"a follower (leader: member {leader})"))
            inj.pids = [node.proc.pid] if node.proc is not None else []
            self.etcd.kill(f.slot)
            self._at(now + (f.duration or 1.0), lambda: self._restart_etcd(inj))
        elif f.kind == "partition":
            self.net.cut(f.slot)
            inj.pids = [p for s, h in enumerate(self.host_of) if h == f.slot and (p := self._pid(s)) is not None]
            self._at(now + (f.duration or 2 * hb), lambda: self._heal(inj, f.slot))
        self.say(f"  t+{now - self.t0:5.1f}s step {self.job_step}: {f}")
        return True

    def _kill_holders(self) -> None:
        """``stale``, second half: the others committed STALE_GAP steps without the frozen worker;
        SIGKILL every worker that holds that newer state at once, and resume the frozen one
        ``duration`` later. From here the job must stop (StateLostError), not train on."""
        assert self.stale is not None
        inj, frozen, _ = self.stale
        self.stale = None
        f, mesh = inj.fault, self.spec.mesh
        holders = [s for s in range(self.spec.world_size)
                   if s != f.slot and (mesh is None or s // mesh[1] != f.slot // mesh[1])]
        live = [s for s in holders if self._pid(s) is not None]
        inj.pids += [self._signal(s, signal.SIGKILL) for s in live]
        inj.t_end = self.lost_at = time.time()
        self._at(self.lost_at + (f.duration or 1.0), lambda: self._cont(frozen))
        self.say(f"  t+{self.lost_at - self.t0:5.1f}s step {self.job_step}: killed the holders of the newer state "
                 f"(slots {live}); slot {f.slot} resumes in {f.duration:g} s")

    def _arm(self, inj: Injected) -> bool:
        """``--mesh``: let the worker armed with ``inj`` (die_vote / die_after_vote) die now (the
        job's hook waits for this key); False if the store is unreachable (next tick again)."""
        from ftc10d.store_connect import connect_client

        if self.coord is not None and self.coord.frozen:
            return False  # a store_stop in progress: its thaw must not wait on this (next tick again)
        op = "vote" if inj.fault.kind == "die_vote" else "after_vote"
        host, _, port = self.launchers[0].coordinator_address.rpartition(":")
        try:
            store = connect_client(host.strip("[]"), int(port), timedelta(seconds=2))
            store.set(f"chaos/{self.trial_id}/armed/{op}", "1")
        except Exception:  # a store fault in progress
            return False
        self.say(f"  t+{time.time() - self.t0:5.1f}s step {self.job_step}: armed {inj.fault}")
        return True

    def _replica_slots(self, replica: int) -> list[int]:
        assert self.spec.mesh is not None
        shard_size = self.spec.mesh[1]
        return list(range(replica * shard_size, (replica + 1) * shard_size))

    def _mesh_whole(self, now: float) -> bool:
        """``--mesh``: every slot's worker committed within :data:`WHOLE_S`: the mesh is whole and
        trains (the last fault's replacements received their shards), so a fault never takes the
        last holder of a shard whose new holder is still on its way."""
        for s in range(self.spec.world_size):
            pid = self._pid(s)
            if pid is None or now - self.last_commit.get(pid, 0.0) > WHOLE_S:
                return False
        return True

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        self.timers.append((t, fn))

    def _resume(self, inj: Injected, pid: int) -> None:
        self._cont(pid)
        inj.t_end = time.time()

    def _restart_store(self, inj: Injected) -> None:
        assert self.coord is not None
        self.coord.start()
        inj.t_end = time.time()

    def _thaw_store(self, inj: Injected) -> None:
        assert self.coord is not None
        self.coord.thaw()
        inj.t_end = time.time()

    def _etcd_whole(self, slot: int) -> bool:
        """Every etcd member but ``slot`` is up and healthy: an earlier etcd fault's member
        restarted and caught up (else the trial waits, like a fault whose slot is empty)."""
        assert self.etcd is not None
        return all(self.etcd.healthy(i) for i in range(len(self.etcd.nodes)) if i != slot)

    def _restart_etcd(self, inj: Injected) -> None:
        assert self.etcd is not None
        self.etcd.restart(inj.fault.slot)
        inj.t_end = time.time()

    def _heal(self, inj: Injected, host: int) -> None:
        self.net.heal(host)
        inj.t_end = time.time()

    def _duty_cycle(self, inj: Injected, pid: int, t: float, end: float) -> None:
        """Stopped for SLOW_STOPPED of every SLOW_PERIOD_S until ``end`` (each pause far below hb)."""
        stop_s = SLOW_PERIOD_S * SLOW_STOPPED

        def cont() -> None:
            self._cont(pid)
            nxt = time.time() + SLOW_PERIOD_S - stop_s
            if nxt >= end:
                inj.t_end = time.time()
            else:
                self._at(nxt, stop)

        def stop() -> None:
            try:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
            except ProcessLookupError:
                inj.t_end = time.time()
                return
            self._at(time.time() + stop_s, cont)

        self._at(t + stop_s, cont)

    # ------------------------------------------------------------ the run

    def run(self) -> TrialResult:
        spec = self.spec
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.events_dir, ignore_errors=True)  # events of an earlier run here would mix in
        self.events_dir.mkdir()
        (self.folder / "spec.json").write_text(json.dumps(spec.to_json(), indent=1))
        shm_before = checks.shm_entries()
        sockets_before = checks.own_listening_sockets()
        self.t0 = time.time()
        self.job_step = 0
        injected = [Injected(f) for f in sorted(spec.faults, key=lambda f: f.at_step)]
        pending = [i for i in injected if i.fault.kind not in ("die_vote", "die_after_vote")]
        # --mesh: a die in the vote is armed only once the mesh is whole (like an injected fault):
        # else it could take the last holder of a shard whose replacement is still on its way.
        to_arm = [i for i in injected if spec.mesh is not None and i.fault.kind in ("die_vote", "die_after_vote")]
        violations: list[str] = []
        rc: Optional[int] = None
        chain: Optional[dict[int, list[str]]] = None
        coordinator_port: Optional[int] = None
        coordinator_sockets: set[str] = set()
        tail = Tail(self.events_dir)
        deadline = time.monotonic() + spec.timeout
        try:
            self.net.start()
            self._launch()
            coordinator_port = int(self.launchers[0].coordinator_address.rpartition(":")[2])
            coordinator_sockets = checks.listening_inodes(coordinator_port)
            waiting_since: dict[int, float] = {}
            while rc is None:
                for e in tail.poll():
                    if e.get("pid"):
                        self.pids.add(int(e["pid"]))
                    if e["kind"] == "commit":
                        self.job_step = max(self.job_step, int(e["step"]))
                        self.last_commit[int(e["pid"])] = float(e["t"])
                now = time.time()
                for item in sorted([t for t in self.timers if t[0] <= now], key=lambda t: t[0]):
                    self.timers.remove(item)
                    item[1]()
                if self.stale is not None and self.job_step >= self.stale[2]:
                    self._kill_holders()
                if to_arm and self.job_step >= to_arm[0].fault.at_step and self._mesh_whole(now) \
                        and self._arm(to_arm[0]):
                    to_arm.pop(0)
                while pending and self.job_step >= pending[0].fault.at_step:
                    inj = pending[0]
                    if self.job_step >= spec.steps - 3:
                        inj.skipped = f"the job reached step {self.job_step} before the fault could be injected"
                    elif not self._inject(inj):
                        first = waiting_since.setdefault(id(inj), time.monotonic())
                        if time.monotonic() - first < RETARGET_S:
                            break
                        inj.skipped = (f"an earlier etcd fault's member was not healthy again for {RETARGET_S:g} s"
                                       if inj.fault.kind == "etcd" else
                                       f"the mesh was not whole (a slot's worker not training) for {RETARGET_S:g} s"
                                       if spec.mesh is not None else
                                       f"no live worker in the slot for {RETARGET_S:g} s")
                    pending.pop(0)
                for launcher in self.launchers:
                    self.pids.update(launcher.spare_pids())
                if time.monotonic() > deadline:
                    violations.append(f"hang: the job did not finish within {spec.timeout:g} s (job step "
                                      f"{self.job_step} of {spec.steps}; live workers "
                                      f"{[lc.pids() for lc in self.launchers]})")
                    break
                codes = []
                for launcher in self.launchers:
                    try:
                        codes.append(launcher.wait(timeout=0))
                    except TimeoutError:
                        codes.append(None)
                if all(c is not None for c in codes):
                    rc = max(codes)  # type: ignore[type-var]
                    break
                time.sleep(TICK_S)
            if self.coord is not None:
                self.coord.thaw()  # a store_stop cut short by the end of the trial: the chain is read from it
            chain = self._read_chain()
            if self.etcd is not None:
                try:  # the restarted member must be back in the cluster (a trial's last fault may be recent)
                    self.etcd.wait_healthy(timeout=15.0)
                except RuntimeError as exc:
                    violations.append(f"the etcd cluster is not whole again after the trial: {exc}"[:1000])
        except Exception as exc:
            logger.exception("chaos: trial %s failed to run", spec.seed)
            violations.append(f"the trial could not run: {type(exc).__name__}: {exc}")
        finally:
            self.t_close = time.time()
            if self.coord is not None:
                self.coord.thaw()  # before anything below talks to the store
            for pid in list(self.stopped):
                self._cont(pid)
            for host in list(self.net.cut_hosts):
                try:
                    self.net.heal(host)
                except Exception:
                    pass
            for launcher in reversed(self.launchers):
                self.pids.update(launcher.spare_pids())
                self.pids.update(launcher.pids().values())
                launcher.close()
            if self.coord is not None:
                self.coord.close()
                self.pids.update(self.coord.pids)
            if self.etcd is not None:
                self.etcd.stop()
                self.pids.update(self.etcd.pids)
            self.net.close()
        duration = time.time() - self.t0
        events = checks.read_events(self.events_dir)
        self.pids.update(int(e["pid"]) for e in events)
        if self.lost_at is None:
            self.lost_at = self._unplanned_loss(events)
        lost = self.lost_at is not None
        if lost:  # invariant 8: the job stops; it never trains on from the older state
            violations += checks.check_state_lost(events, rc, self.lost_at or 0.0)
        elif rc not in (None, 0):
            violations.append(f"the job failed: launcher exit code {rc}")
        violations += self._unexpected_exits(events)
        violations += checks.check_commits(events, spec.steps, complete=not lost)
        violations += checks.check_one_history(events)
        if spec.mesh is not None and not lost:
            held = {e.get("shard") for e in events if e["kind"] == "final"}
            lost = [k for k in range(spec.mesh[1]) if k not in held]
            if lost:
                violations.append(f"no worker finished holding shard(s) {lost} of the "
                                  f"{spec.mesh[0]}x{spec.mesh[1]} mesh")
        violations += checks.check_fencing(events, chain,
                                           store_restarted=any(i.fault.kind == "store" and i.t_fault for i in injected))
        violations += checks.check_lineage(events, _sigkilled(injected))
        violations += checks.check_guards(events)
        for inj in pending:
            if inj.skipped is None:
                inj.skipped = "never injected (the job ended or hung first)"
        self._timing(injected, events)
        left = checks.wait_no_leftovers(self.pids)
        if left:
            violations.append(f"processes left running: {left}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        leaked, other = checks.leaked_shm(shm_before, self.pids)
        if leaked:
            violations.append(f"leaked /dev/shm entries: {leaked}")
        if other:
            self.notes.append(f"new /dev/shm entries not attributable to the trial: {other[:5]}")
        listening = checks.listening_ports()
        if coordinator_port is not None and coordinator_port in listening:
            owners = checks.listening_owners(coordinator_port)
            if (not owners or set(owners) & (self.pids | {os.getpid()})  # the launchers run in this process
                    or checks.listening_inodes(coordinator_port) & coordinator_sockets):  # the very socket
                violations.append(f"the coordinator's port {coordinator_port} is still listening"
                                  + (f" (held by {owners})" if owners else ""))
            else:  # the trial's processes are gone (checked above): another process took the port since
                self.notes.append(f"the coordinator's port {coordinator_port} is listening again, held by "
                                  f"processes outside the trial: {owners}")
        if self.etcd is not None and set(self.etcd.ports) & listening:
            violations.append(f"etcd ports still listening: {sorted(set(self.etcd.ports) & listening)}")
        if checks.own_listening_sockets() > sockets_before:
            violations.append("the chaos runner holds more listening sockets than before the trial")
        pause = checks.longest_pause(checks.commit_times(events))
        bound = checks.pause_bound(spec)
        if pause is not None and pause > bound:
            gap = checks.longest_pause_at(checks.commit_times(events))
            violations.append(f"the job paused {pause:.2f} s between two commits (steps {gap[0]} -> {gap[1]}), "
                              f"above its bound of {bound:g} s")
        return TrialResult(spec, checks.condense(violations), injected, duration, rc, self.notes, str(self.folder),
                           checks.coverage(events), pause, bound)

    def _read_chain(self) -> Optional[dict[int, list[str]]]:
        """epoch -> member ids of every configuration, from the membership store (the coordinator
        or etcd, before it closes)."""
        from ftc10d.membership import Agreement
        from ftc10d.membership.records import Signer

        try:
            ag = Agreement(self.launchers[0].membership_store(), Signer(None))
            latest = ag.latest()
            if latest is None:
                return None
            chain = {}
            for ep in range(1, latest.epoch + 1):
                cfg = ag.read_config(ep)
                if cfg is not None:
                    chain[ep] = list(cfg.members)
            ag.store.close()
            return chain
        except Exception as exc:
            self.notes.append(f"could not read the membership chain: {exc}")
            return None

    def _unplanned_loss(self, events: list[dict[str, Any]]) -> Optional[float]:
        """When the schedule's deaths took every holder of the job's newest committed state
        without a ``stale`` fault (a double kill beside an armed ``die_*``): the time the job
        found it lost (its first ``state_lost`` event), so that the trial is checked as a loss
        (the job must stop with exit 86, invariant 8). None when some holder was not killed by
        the schedule (then a ``state_lost`` is a wait for it, and the usual checks apply)."""
        found = [float(e["t"]) for e in events if e["kind"] == "state_lost"]
        commits = [e for e in events if e["kind"] == "commit"]
        if not found or not commits:
            return None
        newest = max(int(e["step"]) for e in commits)
        holders = {int(e["pid"]) for e in commits if int(e["step"]) == newest}
        dead = self.killed | {int(e["pid"]) for e in events if e["kind"] == "suicide"}
        if not holders <= dead:
            return None
        self.say(f"  every holder of step {newest} died (pids {sorted(holders)}): the job must stop")
        return min(found)

    def _unexpected_exits(self, events: list[dict[str, Any]]) -> list[str]:
        """Workers that exited non-zero without being killed by the schedule (a crash under faults)."""
        from ftc10d.launch import EXIT_STOP_JOB

        suicides = {int(e["pid"]) for e in events if e["kind"] == "suicide"}
        # After a state loss (a stale fault) the job stops: exit 86, and the others are stopped by the launcher.
        stop = min((float(e["t"]) for e in events if e["kind"] == "state_lost_exit"), default=float("inf"))
        out = []
        for ev in self.launch_events:
            if ev.kind != "exited" or ev.detail.get("returncode") in (0, None):
                continue
            if self.lost_at is not None and (ev.detail.get("returncode") == EXIT_STOP_JOB or ev.time >= stop):
                continue
            if ev.pid in self.killed or ev.pid in suicides:
                continue
            if ev.time >= self.t_close:  # the launcher's shutdown after a hang
                continue
            out.append(f"worker pid {ev.pid} (slot {ev.slot}) exited with {ev.detail} without being killed "
                       f"(log: {self.folder / 'logs'})")
        return out

    def _timing(self, injected: list[Injected], events: list[dict[str, Any]]) -> None:
        """Fill in die_vote's and die_after_vote's time (when the worker killed itself) and every
        fault's stall."""
        suicides = sorted((e["t"], e) for e in events if e["kind"] == "suicide")
        for inj in injected:
            if inj.fault.kind in ("die_vote", "die_after_vote"):
                op = "vote" if inj.fault.kind == "die_vote" else "after_vote"
                hit = [e for _, e in suicides if e["op"] == op]
                if hit:
                    inj.t_fault = inj.t_end = hit[0]["t"]
                    inj.pids = [hit[0]["pid"]]
                else:
                    inj.skipped = "the armed worker never died in a vote (it was replaced first?)"
        times = checks.commit_times(events)
        done = sorted((i for i in injected if i.t_fault is not None), key=lambda i: i.t_fault or 0.0)
        for k, inj in enumerate(done):
            until = (inj.t_end or inj.t_fault or 0.0) + 3.0
            if k + 1 < len(done):
                until = min(until, done[k + 1].t_fault or until)
            inj.stall_s = checks.stall_after(times, inj.t_fault or 0.0, until)
            if inj.stall_s is None:
                inj.stall_s = float("inf")


def run_trial(spec: TrialSpec, folder: Path, say: Callable[[str], None] = lambda s: None) -> TrialResult:
    with launchers_log(folder / "logs" / "launchers.log"):
        return Trial(spec, folder, say).run()


@contextlib.contextmanager
def launchers_log(path: Path) -> Iterator[None]:
    """The launchers (node agents, supervisors) run in this process: their ``ftc10d`` log lines
    at INFO go to ``path`` for the trial (kept with the workers' logs when a trial fails), so
    that a violation's node-agent side can be read (a store restart paused 5.25 s in one
    trial of a hundred, and nothing said why). Warnings still reach stderr as before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO)
    extra: list[logging.Handler] = []
    if not logging.getLogger().handlers:  # without -v, warnings went to Python's last-resort stderr
        extra.append(logging.StreamHandler(sys.stderr))
        extra[0].setLevel(logging.WARNING)
    level = logger.level
    for h in (handler, *extra):
        logger.addHandler(h)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(level)
        for h in (handler, *extra):
            logger.removeHandler(h)
        handler.close()


if __name__ == "__main__":  # pragma: no cover - a quick manual run: python -m ftc10d.chaos.trial SEED
    from ftc10d.chaos.schedule import draw

    result = run_trial(draw(int(sys.argv[1])), Path(sys.argv[2] if len(sys.argv) > 2 else "chaos-trial"), print)
    print(json.dumps(result.to_json(), indent=1))


def _sigkilled(injected: list[Injected]) -> dict[int, float]:
    """pid -> when the schedule SIGKILLed it (for the lineage check: what died with it)."""
    out: dict[int, float] = {}
    for inj in injected:
        if not inj.t_fault or not inj.pids:
            continue
        if inj.fault.kind in ("kill", "die_send", "double") and inj.pids[0] is not None:
            out[int(inj.pids[0])] = float(inj.t_fault)
        if inj.fault.kind == "node":
            out.update((int(p), float(inj.t_fault)) for p in inj.pids if p is not None)
        if inj.fault.kind == "stale" and inj.t_end:  # pids[0] is the frozen one; the others, the holders
            out.update((int(p), float(inj.t_end)) for p in inj.pids[1:] if p is not None)
        if inj.fault.kind == "double" and inj.fault.kind2 == "kill" and len(inj.pids) > 1 and inj.pids[1]:
            out[int(inj.pids[1])] = float(inj.t_end or inj.t_fault)
    return out

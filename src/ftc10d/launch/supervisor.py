"""``Launcher``: runs a node's workers, replaces only the one that died, keeps warm spares.

One supervisor thread owns every child process from spawn to reap. It blocks
in ``poll()`` on one pidfd per child (plus each spare's readiness pipe and a
wake-up pipe), so a death is seen within milliseconds of the kernel noticing it,
not at the next tick of a polling loop. On a death it reads the worker's
reconfigure handle from the coordinator store (published by
``ftc10d.train.init_from_env`` under ``handle_key(launch_id, pid)``) and calls
``Agreement.report_exit(handle)``: a *confirmed* removal, which needs no
majority and no heartbeat timeout. Then it respawns that slot alone, from a
warm spare if one is there, and starts a new spare.

Why the spawning happens on that one thread: children are started with
``PR_SET_PDEATHSIG = SIGKILL``, which fires when the *thread* that forked them
exits, not the process. A child forked from a short-lived thread would be
killed with it. The supervisor thread lives until every child is reaped, and
if the launcher process dies (even by SIGKILL) the kernel kills the children:
no orphans. Each child also leads its own process group, so that shutdown
reaches whatever the worker itself started.

The launcher hosts the membership coordinator (``ftc10d.membership.tcp
.Coordinator``) unless given one, so the store outlives any worker. With
``membership_endpoints`` the membership lives in etcd instead (the coordinator
store then only serves the group's rendezvous and the handle keys), and exits
are reported there: the same backend, and the same key prefix, as the workers'.

With ``membership_unit="node"`` (the default) the launcher is also its node's
member (:class:`ftc10d.membership.agent.NodeAgent`): it heartbeats, watches
and detects for its workers, which reach it over a local socket
(``$FTC10D_NODE_AGENT``), so that the store serves one member per node.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
import uuid as uuid_mod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from ftc10d.launch.config import LaunchConfig, parse_address
from ftc10d.launch.env import base_env, worker_env
from ftc10d.launch.procs import Proc, child_setup, killpg, pidfd, reap, signal_name
from ftc10d.types import EXIT_STOP_JOB, InvalidOptionError

logger = logging.getLogger("ftc10d")


#: How long workers get to exit after SIGTERM/SIGINT before they are SIGKILLed.
DEFAULT_GRACE_S = 5.0
#: Spares that die before becoming ready this many times in a row are not replaced any more.
MAX_SPARE_FAILURES = 3
#: Poll period when pidfds are unavailable (waitpid polling).
_FALLBACK_POLL_S = 0.005

#: Coordinator-store key of the job's etcd prefix (set by the first launcher of the job).
MEMBERSHIP_PREFIX_KEY = "ftc10d/launch/membership_prefix"

#: Membership-store key of a job-wide stop: a launcher whose worker exited ``EXIT_STOP_JOB``
#: writes it (a signed record), and every other node's launcher stops its workers too.
JOB_STOP_KEY = "job/stop"

#: spare.py, run by its path for a cold start (``-m ftc10d.launch.spare`` would import torch first).
_SPARE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spare.py")

EventCallback = Callable[["LaunchEvent"], None]


@dataclass(frozen=True)
class LaunchEvent:
    """Something the launcher did or saw. ``detail`` by kind:
    exited ``{"returncode", "signal"}``; reported ``{"epoch"}``; respawned ``{"warm", "restart"}``;
    finished ``{"returncode"}``; spare_ready ``{"ready_s"}``; started ``{"restart", "warm"}``;
    gave_up ``{"restarts", "returncode", "signal", "stop_job"}`` (the job then stops)."""

    kind: str
    slot: Optional[int]
    pid: Optional[int]
    time: float
    detail: dict = field(default_factory=dict)


@dataclass
class _Slot:
    index: int
    restarts: int = 0
    state: str = "running"  # running | done | gave_up
    proc: Optional[Proc] = None


class Launcher:
    """Runs ``config.nproc_per_node`` workers of ``config.script`` and keeps them going.

    ``on_event`` is called on the supervisor thread for every :class:`LaunchEvent`;
    keep it short (an exception in it is logged and ignored). Use as a context
    manager, or ``start()`` ... ``wait()`` ... ``close()``.
    """

    def __init__(self, config: LaunchConfig, on_event: Optional[EventCallback] = None, *,
                 agent_thread_init: Optional[Callable[[], None]] = None) -> None:
        self.config = config
        self.on_event = on_event
        #: Run first by each thread of the node agent (``NodeAgent(thread_init=)``).
        self.agent_thread_init = agent_thread_init
        self.grace = DEFAULT_GRACE_S
        self._launch_id = uuid_mod.uuid4().hex[:12]
        self._coordinator: Any = None
        self._address: Optional[str] = None
        self._agreement: Any = None
        self._store: Any = None  # raw TCPStore client: the workers' handle keys
        self._membership_prefix: Optional[str] = None  # etcd only: the job's key prefix
        self._agent: Any = None  # the node agent (membership_unit "node")
        self._slots: list[_Slot] = []
        self._spares: list[Proc] = []
        self._spare_failures = 0
        self._spare_seq = 0
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop_signal: Optional[int] = None
        self._job_stopped: Optional[dict[str, Any]] = None  # another node's stop record, once seen
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._done = threading.Event()
        self._result: Optional[int] = None
        self._events: list[LaunchEvent] = []

    # ================================================================ public API

    def start(self) -> "Launcher":
        """Host (or connect to) the coordinator, then start the workers and the spares.
        Returns once every worker process exists."""
        if self._thread is not None:
            return self
        self.config.validate()
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
        self._connect()
        self._thread = threading.Thread(target=self._run, name="ftc10d-launcher", daemon=True)
        self._thread.start()
        if self.config.nnodes > 1 or self.config.coordinator is not None:
            threading.Thread(target=self._watch_job_stop, name="ftc10d-launcher-stop-watch", daemon=True).start()
        self._started.wait()
        if self._start_error is not None:
            self.close()
            raise self._start_error
        return self

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of the coordinator the workers use."""
        if self._address is None:
            raise RuntimeError("start() the launcher first")
        return self._address

    @property
    def launch_id(self) -> str:
        return self._launch_id

    def membership_store(self) -> Any:
        """A new client of the job's membership backend (etcd or the coordinator store),
        e.g. to read the chain of configurations."""
        from ftc10d.train.bootstrap import membership_store

        host, port = parse_address(self.coordinator_address)
        return membership_store(host, port, tuple(self.config.membership_endpoints or ()), self._membership_prefix)

    @property
    def events(self) -> list[LaunchEvent]:
        """Every event so far (a copy), in order."""
        with self._lock:
            return list(self._events)

    def pids(self) -> dict[int, int]:
        """slot -> pid of its live worker (slots finished or given up are absent)."""
        with self._lock:
            return {s.index: s.proc.pid for s in self._slots if s.proc is not None}

    def spare_pids(self) -> list[int]:
        """Pids of the spares (ready or still importing)."""
        with self._lock:
            return [p.pid for p in self._spares]

    def kill(self, slot: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the worker of ``slot`` (not its process group); returns its pid."""
        with self._lock:
            if not 0 <= slot < len(self._slots) or self._slots[slot].proc is None:
                raise InvalidOptionError(f"slot {slot} has no live worker; live slots: {sorted(self.pids())}")
            pid = self._slots[slot].proc.pid  # type: ignore[union-attr]
        os.kill(pid, sig)
        return pid

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until every slot's worker exited 0 (-> 0) or the job cannot go on (-> nonzero:
        1 when a slot gave up, EXIT_STOP_JOB, or 128+signal after :meth:`stop`). TimeoutError on timeout."""
        if self._thread is None:
            raise RuntimeError("start() the launcher first")
        if not self._done.wait(timeout):
            raise TimeoutError(f"the job is still running after {timeout} s")
        assert self._result is not None
        return self._result

    @property
    def returncode(self) -> Optional[int]:
        """The job's exit code once it ended (what :meth:`wait` returns), None while it runs."""
        return self._result if self._done.is_set() else None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Forward ``sig`` to every worker, SIGKILL those still there after ``grace``
        seconds; :meth:`wait` then returns 128+sig. Safe to call from a signal handler."""
        self._stop_signal = sig
        self._wake()

    def close(self) -> None:
        """Terminate workers and spares, reap them, stop the coordinator. Idempotent."""
        if self._thread is not None and self._thread.is_alive():
            if self._stop_signal is None:
                self._stop_signal = signal.SIGTERM
            self._wake()
            self._thread.join()
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None
        if self._agreement is not None and self.config.membership_endpoints is not None:
            self._agreement.store.close()  # etcd's HTTP sessions (a TCP agreement shares the coordinator's)
        self._store = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> "Launcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ============================================================== coordinator

    def _connect(self) -> None:
        """Host the coordinator here, or connect to the one given; the Agreement through
        which exits are reported uses the job's token, like the workers' records."""
        from ftc10d.membership import Agreement, Coordinator, TCPMembershipStore
        from ftc10d.store_connect import connect_client
        from ftc10d.membership.records import Signer

        cfg = self.config
        token = cfg.effective_token
        etcd = cfg.membership_endpoints is not None
        if cfg.coordinator is None:
            # With etcd, the coordinator store holds no membership to watch: members watch each other.
            self._coordinator = Coordinator(cfg.host, cfg.port, token=token, detect=not etcd, notify=not etcd,
                                            heartbeat_timeout=cfg.heartbeat_timeout).start()
            host = self._coordinator.host
            connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
            self._address = f"{connect_host}:{self._coordinator.port}"
            self._agreement = self._coordinator.agreement()
            self._store = self._coordinator.store
            logger.info("launcher %s: coordinator listening on %s", self._launch_id, self._coordinator.address)
        else:
            host, port = parse_address(cfg.coordinator)
            self._address = cfg.coordinator
            self._agreement = Agreement(TCPMembershipStore(host, port), Signer(token))
            self._store = connect_client(host, port, timedelta(seconds=30))
            logger.info("launcher %s: using coordinator %s", self._launch_id, cfg.coordinator)
        if etcd:
            self._membership_prefix = self._agree_prefix()
            self._agreement = Agreement(self.membership_store(), Signer(token))
            logger.info("launcher %s: membership in etcd %s", self._launch_id, self._agreement.store.describe())
        if cfg.membership_unit == "node":
            from ftc10d.membership.agent import NodeAgent

            self._agent = NodeAgent(self.membership_store(), token=token, heartbeat_timeout=cfg.heartbeat_timeout,
                                    thread_init=self.agent_thread_init).start()

    def _agree_prefix(self) -> str:
        """The job's etcd key prefix: the first launcher to ask proposes one of its own, the
        others (every node's launcher shares the coordinator store) adopt it. A fresh prefix per
        job keeps a rerun from finding the last run's configuration (its members all gone, no
        majority left to change it) in a cluster that outlives jobs."""
        from ftc10d.membership.etcd import DEFAULT_PREFIX

        mine = f"{DEFAULT_PREFIX}{self._launch_id}/"
        return bytes(self._store.compare_set(MEMBERSHIP_PREFIX_KEY, "", mine)).decode()

    def _report_exit(self, proc: Proc) -> None:
        """Name the dead worker to the membership at once (a confirmed removal)."""
        from ftc10d.train.bootstrap import handle_key

        key = handle_key(self._launch_id, proc.pid)
        try:
            if not self._store.check([key]):
                logger.info("launcher: worker %d (slot %s) exited before publishing its handle; nothing to report",
                            proc.pid, proc.slot)
                return
            handle = self._store.get(key).decode()
            # The node agent holds the configuration: the chain is read from it, not from its start.
            known = self._agent.current if self._agent is not None else None
            out = self._agreement.report_exit(handle, known=known)
        except Exception:
            logger.warning("launcher: could not report the exit of worker %d to the membership", proc.pid,
                           exc_info=True)
            return
        epoch = None if out.config is None else out.config.epoch
        if out.blocked:  # expected when the last members finish: nobody is left to form a configuration
            logger.log(logging.INFO if proc.popen.returncode == 0 else logging.WARNING,
                       "launcher: exit of worker %d reported, but: %s", proc.pid, out.blocked)
        self._emit("reported", proc.slot, proc.pid, epoch=epoch, changed=out.changed)

    # =================================================================== spawning

    def _popen(self, argv: list[str], env: dict[str, str], name: str, pass_fds: tuple[int, ...] = ()) -> tuple[
            subprocess.Popen, list[Any]]:
        files: list[Any] = []
        out: Any = None
        err: Any = None
        if self.config.log_dir:
            out = open(os.path.join(self.config.log_dir, f"{name}.out"), "ab")
            err = open(os.path.join(self.config.log_dir, f"{name}.err"), "ab")
            files = [out, err]
        popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 pass_fds=pass_fds, preexec_fn=child_setup(os.getpid()))
        return popen, files

    def _log_names(self, slot: int, restart: int) -> tuple[Optional[str], Optional[str]]:
        if not self.config.log_dir:
            return None, None
        base = os.path.join(self.config.log_dir, f"worker{slot}.{restart}")
        return base + ".out", base + ".err"

    def _start_worker(self, slot: _Slot) -> None:
        """Start ``slot``'s worker: promote a spare if there is one (ready ones first), else cold."""
        cfg = self.config
        env = worker_env(cfg, local_rank=slot.index, restart=slot.restarts, coordinator=self.coordinator_address,
                         launch_id=self._launch_id, membership_prefix=self._membership_prefix,
                         node_agent=self._agent.path if self._agent is not None else None)
        spare = self._take_spare()
        if spare is not None:
            out, err = self._log_names(slot.index, slot.restarts)
            message = json.dumps({"env": env, "argv": list(cfg.script_args), "stdout": out, "stderr": err}).encode()
            try:
                assert spare.control is not None
                os.write(spare.control, message)  # far below the pipe's buffer: never blocks
                os.close(spare.control)
                spare.control = None
            except OSError:
                logger.warning("launcher: spare %d could not be promoted (it died?); starting slot %d cold",
                               spare.pid, slot.index)
                self._retire(spare)
                spare = None
        if spare is not None:
            proc = spare
            proc.slot, proc.restart, proc.warm, proc.started = slot.index, slot.restarts, True, time.monotonic()
        else:
            popen, files = self._popen([cfg.python, _SPARE_FILE, "--run", cfg.script, *cfg.script_args], env,
                                       f"worker{slot.index}.{slot.restarts}")
            proc = Proc(popen, pidfd(popen.pid), slot.index, slot.restarts, files=files)
        with self._lock:
            slot.proc = proc
        logger.info("launcher: slot %d: worker %d started (%s, restart %d)", slot.index, proc.pid,
                    "warm spare" if proc.warm else "cold", slot.restarts)
        if slot.restarts:
            self._emit("respawned", slot.index, proc.pid, warm=proc.warm, restart=slot.restarts)
        else:
            self._emit("started", slot.index, proc.pid, warm=proc.warm, restart=0)

    def _take_spare(self) -> Optional[Proc]:
        with self._lock:
            live = [p for p in self._spares if p.control is not None]
            if not live:
                return None
            live.sort(key=lambda p: (not p.ready, p.started))
            spare = live[0]
            self._spares.remove(spare)
        if spare.ready_fd is not None:
            os.close(spare.ready_fd)
            spare.ready_fd = None
        return spare

    def _start_spare(self) -> None:
        cfg = self.config
        control_r, control_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self._spare_seq += 1
        argv = [cfg.python, "-m", "ftc10d.launch.spare", "--control-fd", str(control_r), "--ready-fd", str(ready_w),
                cfg.script]
        try:
            popen, files = self._popen(argv, base_env(cfg), f"spare{self._spare_seq}", pass_fds=(control_r, ready_w))
        finally:
            os.close(control_r)
            os.close(ready_w)
        proc = Proc(popen, pidfd(popen.pid), None, control=control_w, ready_fd=ready_r, files=files)
        with self._lock:
            self._spares.append(proc)
        logger.info("launcher: spare %d starting", proc.pid)

    def _retire(self, proc: Proc) -> None:
        """Forget a spare: close its pipes (EOF = exit 0), make sure it goes."""
        with self._lock:
            if proc in self._spares:
                self._spares.remove(proc)
        for attr in ("control", "ready_fd"):
            fd = getattr(proc, attr)
            if fd is not None:
                os.close(fd)
                setattr(proc, attr, None)

    # ================================================================ supervisor

    def _run(self) -> None:
        try:
            for i in range(self.config.nproc_per_node):
                self._slots.append(_Slot(i))
            for slot in self._slots:
                self._start_worker(slot)
            for _ in range(self.config.spares):
                self._start_spare()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            self._shutdown(signal.SIGKILL)
            self._finish(1)
            return
        self._started.set()
        try:
            self._loop()
        except Exception:
            logger.exception("launcher: the supervisor failed; stopping the job")
            self._shutdown(signal.SIGTERM)
            self._finish(1)

    def _all_procs(self) -> list[Proc]:
        with self._lock:
            return [s.proc for s in self._slots if s.proc is not None] + list(self._spares)

    def _loop(self) -> None:
        poller = select.poll()
        while True:
            if self._stop_signal is not None:
                sig = self._stop_signal
                logger.warning("launcher: stopping on %s: forwarding it to the workers", signal.Signals(sig).name)
                self._shutdown(sig)
                self._finish(128 + sig)
                return
            if self._job_stopped is not None:
                self._emit("job_stopped", None, None, **self._job_stopped)
                self._shutdown(signal.SIGTERM)
                self._finish(EXIT_STOP_JOB)
                return
            procs = self._all_procs()
            fds: dict[int, tuple[str, Proc]] = {}
            fallback = False
            for p in procs:
                if p.pidfd is not None:
                    fds[p.pidfd] = ("exit", p)
                else:
                    fallback = True
                if p.ready_fd is not None:
                    fds[p.ready_fd] = ("ready", p)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            try:
                ready = poller.poll(_FALLBACK_POLL_S * 1000 if fallback else None)
            finally:
                for fd in list(fds) + [self._wake_r]:
                    poller.unregister(fd)
            for fd, _ in ready:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                what, proc = fds[fd]
                if what == "ready":
                    self._on_ready(proc)
            for p in procs:
                if p.pidfd is not None and not any(fd == p.pidfd for fd, _ in ready):
                    continue
                rc = reap(p, block=False)
                if rc is not None:
                    self._on_exit(p, rc)
                    if self._done.is_set():
                        return

    def _on_ready(self, proc: Proc) -> None:
        assert proc.ready_fd is not None
        try:
            line = os.read(proc.ready_fd, 65536)
        except OSError:
            line = b""
        os.close(proc.ready_fd)
        proc.ready_fd = None
        if not line:
            return  # died while importing: its pidfd says so
        info = json.loads(line)
        proc.ready = True
        self._spare_failures = 0
        ready_s = time.monotonic() - proc.started  # from spawn: interpreter start and imports
        if info.get("skipped"):
            logger.info("launcher: spare %d could not pre-import %s", proc.pid, ", ".join(info["skipped"]))
        logger.info("launcher: spare %d ready %.2f s after its start", proc.pid, ready_s)
        self._emit("spare_ready", None, proc.pid, ready_s=ready_s)

    def _on_exit(self, proc: Proc, rc: int) -> None:
        if proc.slot is None:  # a spare
            self._retire(proc)
            logger.warning("launcher: spare %d exited (%s) before it was needed", proc.pid,
                           signal_name(rc) or f"code {rc}")
            if not proc.ready:
                self._spare_failures += 1
            if self._spare_failures >= MAX_SPARE_FAILURES:
                logger.error("launcher: %d spares died in a row before they were ready; running without spares "
                             "(see their output)", self._spare_failures)
            else:
                self._start_spare()
            return
        slot = self._slots[proc.slot]
        with self._lock:
            slot.proc = None
        self._emit("exited", slot.index, proc.pid, returncode=rc, signal=signal_name(rc))
        self._report_exit(proc)
        if rc == 0:
            slot.state = "done"
            logger.info("launcher: slot %d: worker %d finished", slot.index, proc.pid)
        elif rc != EXIT_STOP_JOB and slot.restarts < self.config.max_restarts:
            logger.warning("launcher: slot %d: worker %d died (%s); respawning that slot only", slot.index, proc.pid,
                           signal_name(rc) or f"exit code {rc}")
            slot.restarts += 1
            self._start_worker(slot)
            self._refill_spares()
        else:
            self._give_up(slot, proc, rc)
            return
        if all(s.state == "done" for s in self._slots):
            logger.info("launcher: job finished: every slot's worker exited 0")
            self._shutdown(signal.SIGTERM)
            self._finish(0)

    def _give_up(self, slot: _Slot, proc: Proc, rc: int) -> None:
        """End the job for a slot that cannot go on, as torchrun does: stop the other workers
        (SIGTERM, SIGKILL after the grace) and exit 1, or EXIT_STOP_JOB when the worker said
        so (e.g. ReplicaDivergenceError: a replacement would only receive a wrong state)."""
        slot.state = "gave_up"
        if rc == EXIT_STOP_JOB:
            logger.error("launcher: slot %d: worker %d exited with %d (EXIT_STOP_JOB: the job cannot go on, see its "
                         "output): stopping the job", slot.index, proc.pid, rc)
        else:
            logger.error("launcher: slot %d gave up: its worker %d died (%s) and the slot used its %d restart(s): "
                         "stopping the job", slot.index, proc.pid, signal_name(rc) or f"exit code {rc}",
                         self.config.max_restarts)
        self._emit("gave_up", slot.index, proc.pid, restarts=slot.restarts, returncode=rc, signal=signal_name(rc),
                   stop_job=rc == EXIT_STOP_JOB)
        if rc == EXIT_STOP_JOB:
            self._announce_job_stop(slot.index, proc.pid)
        self._shutdown(signal.SIGTERM)
        self._finish(EXIT_STOP_JOB if rc == EXIT_STOP_JOB else 1)

    def _announce_job_stop(self, slot: int, pid: int) -> None:
        """Tell the other nodes' launchers that the job stops (a worker exited ``EXIT_STOP_JOB``:
        nobody holds the job's newest state, or the replicas diverged). Without it, only this
        node stopped: the other nodes' workers waited for members that would never come back
        (a chaos trial: a multi-node job hung instead of exiting 86 for a restart from the
        checkpoint). A launcher that gives up for another reason (restarts used up) does not
        stop the job: the other nodes train on without its ranks."""
        from ftc10d.membership.records import Signer

        body = {"code": EXIT_STOP_JOB, "launcher": self._launch_id, "node_rank": self.config.node_rank,
                "slot": slot, "pid": pid, "t": time.time()}
        try:
            store = self.membership_store()
            try:
                store.put(JOB_STOP_KEY, Signer(self.config.effective_token).encode(JOB_STOP_KEY, body))
            finally:
                store.close()
        except Exception as exc:  # the others then find out the way they did before: not at all, or by timeout
            logger.error("launcher: could not tell the other nodes that the job stops: %s", exc)

    def _watch_job_stop(self) -> None:
        """On a job of several nodes: stop this node's workers when another node's launcher
        stopped the job (:meth:`_announce_job_stop`). One store read per second per node (or
        per heartbeat timeout, if longer), beside the node agent's ~10 at a 1-s timeout."""
        from ftc10d.membership.records import Signer

        self._started.wait()
        if self._start_error is not None:
            return
        signer = Signer(self.config.effective_token)
        period = max(1.0, self.config.heartbeat_timeout)
        store = None
        # A record already there at the first read is an earlier run's (a job restarted with
        # --job-restarts on a coordinator that outlived it): only a new one stops this run.
        first, before = True, None
        wait = 0.0
        try:
            while not self._done.wait(wait):
                wait = period
                try:
                    if store is None:
                        store = self.membership_store()
                    raw = store.get(JOB_STOP_KEY)
                except Exception as exc:  # the store unreachable for a while: try again
                    logger.debug("launcher: job-stop watch: %s", exc)
                    continue
                if first:
                    first, before = False, raw
                    continue
                if raw is None or raw == before:
                    continue
                body = signer.decode(JOB_STOP_KEY, raw)
                if body is None or body.get("launcher") == self._launch_id:
                    continue
                logger.error("launcher: node %s stopped the job (its slot %s's worker %s exited %s: the job cannot go "
                             "on); stopping this node's workers", body.get("node_rank"), body.get("slot"),
                             body.get("pid"), body.get("code"))
                self._job_stopped = {"node_rank": body.get("node_rank"), "launcher": body.get("launcher")}
                self._wake()
                return
        finally:
            if store is not None:
                store.close()

    def _refill_spares(self) -> None:
        """Start spares (in the background: they import on their own) up to ``config.spares``."""
        with self._lock:
            missing = self.config.spares - len(self._spares)
        if self._spare_failures >= MAX_SPARE_FAILURES:
            return
        for _ in range(missing):
            self._start_spare()

    # ================================================================= shutdown

    def _shutdown(self, sig: int) -> None:
        """Signal every worker's process group, give them ``grace`` seconds, SIGKILL
        what is left (spares at once: they hold nothing), reap everything."""
        with self._lock:
            spares = list(self._spares)
            workers = [s.proc for s in self._slots if s.proc is not None]
        for p in spares:
            self._retire(p)
            killpg(p, signal.SIGKILL)
        for p in workers:
            killpg(p, signal.SIGCONT)  # a stopped worker would never see sig
            killpg(p, sig)
        deadline = time.monotonic() + (0 if sig == signal.SIGKILL else self.grace)
        pending = list(workers)
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if reap(p, block=False) is None]
            if pending:
                time.sleep(0.01)
        for p in pending:
            logger.warning("launcher: worker %d did not exit within %.1f s of %s: SIGKILL", p.pid, self.grace,
                           signal.Signals(sig).name)
            killpg(p, signal.SIGKILL)
        for p in pending + spares:
            if p.popen.returncode is None:
                reap(p, block=True)
        for p in workers:
            killpg(p, signal.SIGKILL)  # anything the worker left behind in its group
        with self._lock:
            for s in self._slots:
                s.proc = None

    def _finish(self, code: int) -> None:
        self._result = code
        self._emit("finished", None, None, returncode=code)
        self._done.set()

    # ==================================================================== events

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _emit(self, kind: str, slot: Optional[int], pid: Optional[int], **detail: Any) -> None:
        event = LaunchEvent(kind, slot, pid, time.time(), detail)
        with self._lock:
            self._events.append(event)
        logger.debug("launcher event: %s", event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                logger.warning("launcher: the event callback failed on %s", event, exc_info=True)


def run(config: LaunchConfig, on_event: Optional[EventCallback] = None) -> int:
    """Run a job to its end in this thread (what ``ftc10d launch`` does); called on the main
    thread, SIGINT/SIGTERM stop the job cleanly (forwarded, then SIGKILL after the grace)."""
    launcher = Launcher(config, on_event)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
        previous = {sig: signal.signal(sig, lambda signum, _frame: launcher.stop(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        launcher.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


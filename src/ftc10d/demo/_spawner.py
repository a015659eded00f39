"""A minimal stand-in for :class:`ftc10d.launch.Launcher` (same API subset), used by the
demo only while ``ftc10d.launch`` is not available. Hosts a Coordinator, starts one
worker per slot plus warm spares (processes that already imported torch and ftc10d and
wait on stdin for their slot), reports an exited worker's handle to the membership and
hands its slot to a spare.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

logger = logging.getLogger("ftc10d")

_SPARE_BOOT = (
    "import json, os, runpy, sys\n"
    "import torch, torch.distributed, ftc10d.train, ftc10d.demo.worker\n"
    "ftc10d.demo.worker.warm_up()\n"
    "line = sys.stdin.readline()\n"
    "if not line: sys.exit(0)\n"
    "msg = json.loads(line); os.environ.update(msg['env']); sys.argv = [msg['script'], *msg['args']]\n"
    "runpy.run_path(msg['script'], run_name='__main__')\n"
)


@dataclass
class LaunchConfig:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    spares: int = 0
    max_restarts: int = 3
    coordinator: Optional[str] = None
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

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class LaunchEvent:
    kind: str
    slot: Optional[int]
    pid: Optional[int]
    time: float
    detail: dict


class Launcher:
    def __init__(self, config: LaunchConfig, on_event: Optional[Callable[[LaunchEvent], None]] = None) -> None:
        self.config = config
        self.on_event = on_event
        self._id = uuid.uuid4().hex[:12]
        self._co: Any = None
        self._procs: dict[int, subprocess.Popen] = {}
        self._restarts: dict[int, int] = {}
        self._done: set[int] = set()
        self._spares: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failed: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    def _emit(self, kind: str, slot: Optional[int], pid: Optional[int], **detail: Any) -> None:
        if self.on_event is not None:
            self.on_event(LaunchEvent(kind, slot, pid, time.time(), detail))

    @property
    def coordinator_address(self) -> str:
        return self._co.address

    @property
    def launch_id(self) -> str:
        return self._id

    def _env(self, slot: int) -> dict[str, str]:
        c = self.config
        host, port = self._co.host, self._co.port
        restart = str(self._restarts.get(slot, 0))
        env = {
            "RANK": str(slot), "LOCAL_RANK": str(slot), "WORLD_SIZE": str(c.nproc_per_node),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_node), "GROUP_RANK": "0", "NODE_RANK": "0",
            "MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": restart,
            "FTC10D_RESTART_COUNT": restart, "FTC10D_COORDINATOR": f"{host}:{port}", "FTC10D_LAUNCH_ID": self._id,
            "FTC10D_HEARTBEAT_TIMEOUT": str(c.heartbeat_timeout), "FTC10D_MIN_MEMBERS": str(c.min_members or 1),
        }
        env.update(c.env)
        return env

    def _out(self, name: str) -> Any:
        if self.config.log_dir is None:
            return None
        os.makedirs(self.config.log_dir, exist_ok=True)
        return open(os.path.join(self.config.log_dir, name), "ab")

    def _spawn(self, slot: int) -> subprocess.Popen:
        env = {**os.environ, **self._env(slot)}
        out = self._out(f"slot{slot}-r{self._restarts.get(slot, 0)}.log")
        return subprocess.Popen([self.config.python, self.config.script, *self.config.script_args], env=env,
                                stdout=out, stderr=subprocess.STDOUT if out else None)

    def _spare(self) -> subprocess.Popen:
        out = self._out(f"spare-{len(self._spares)}-{time.time():.0f}.log")
        p = subprocess.Popen([self.config.python, "-c", _SPARE_BOOT], env={**os.environ, **self.config.env},
                             stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT if out else None)
        self._emit("spare_ready", None, p.pid)
        return p

    def start(self) -> "Launcher":
        from ftc10d.membership import Coordinator

        self._co = Coordinator(self.config.host, self.config.port, heartbeat_timeout=self.config.heartbeat_timeout,
                               token=self.config.token).start()
        for slot in range(self.config.nproc_per_node):
            p = self._spawn(slot)
            self._procs[slot] = p
            self._emit("started", slot, p.pid)
        self._spares = [self._spare() for _ in range(self.config.spares)]
        self._thread = threading.Thread(target=self._monitor, daemon=True, name="demo-spawner")
        self._thread.start()
        return self

    def pids(self) -> dict[int, int]:
        with self._lock:
            return {s: p.pid for s, p in self._procs.items() if s not in self._done and p.poll() is None}

    def kill(self, slot: int, sig: int = signal.SIGKILL) -> int:
        with self._lock:
            pid = self._procs[slot].pid
        os.kill(pid, sig)
        return pid

    def _report(self, pid: int) -> None:
        from ftc10d.train.bootstrap import handle_key

        store = self._co.store
        key = handle_key(self._id, pid)
        if store.check([key]):
            out = self._co.agreement().report_exit(store.get(key).decode())
            self._emit("reported", None, pid, epoch=out.config.epoch if out.config else None)

    def _monitor(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                items = [(s, p) for s, p in self._procs.items() if s not in self._done]
            for slot, p in items:
                rc = p.poll()
                if rc is None:
                    continue
                sig = signal.Signals(-rc).name if rc < 0 else None
                self._emit("exited", slot, p.pid, returncode=rc, signal=sig)
                if rc == 0:
                    self._done.add(slot)
                    continue
                try:
                    self._report(p.pid)
                except Exception:
                    logger.warning("spawner: report_exit failed", exc_info=True)
                n = self._restarts.get(slot, 0) + 1
                if n > self.config.max_restarts:
                    self._emit("gave_up", slot, p.pid)
                    self._done.add(slot)
                    self._failed = 1
                    continue
                self._restarts[slot] = n
                warm = bool(self._spares)
                if warm:
                    np_ = self._spares.pop(0)
                    msg = {"env": self._env(slot), "script": self.config.script, "args": self.config.script_args}
                    np_.stdin.write((json.dumps(msg) + "\n").encode())
                    np_.stdin.flush()
                    self._spares.append(self._spare())
                else:
                    np_ = self._spawn(slot)
                with self._lock:
                    self._procs[slot] = np_
                self._emit("respawned", slot, np_.pid, warm=warm, restart=n)
            if len(self._done) == self.config.nproc_per_node:
                rc = self._failed or 0
                self._emit("finished", None, None, returncode=rc)
                self._stop.set()
                return
            time.sleep(0.005)

    def wait(self, timeout: Optional[float] = None) -> int:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("workers still running")
        return self._failed or 0

    def close(self) -> None:
        self._stop.set()
        for p in [*self._procs.values(), *self._spares]:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except OSError:
                    pass
        for p in [*self._procs.values(), *self._spares]:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self._co is not None:
            self._co.close()

    def __enter__(self) -> "Launcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

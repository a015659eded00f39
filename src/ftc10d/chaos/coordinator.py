"""The coordinator store as a process of its own, so that a trial can SIGKILL it for real.

Under ``ftc10d launch`` the coordinator lives inside the launcher; killing it there would
kill the launcher too. For the ``store`` fault the trial runs ``ftc10d coordinator`` as a
child (its own session), points every launcher at it (``LaunchConfig.coordinator``),
SIGKILLs it and restarts it on the same port: the store's state is gone (it is in
memory), the members notice the new incarnation, rejoin and re-form with a fresh uuid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class CoordinatorProcess:
    """``ftc10d coordinator`` on ``host:port``; :meth:`kill` and :meth:`start` again."""

    def __init__(self, host: str, heartbeat_timeout: float, env: dict[str, str]) -> None:
        self.host = host
        self.port = free_port(host)
        self.heartbeat_timeout = heartbeat_timeout
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.pids: set[int] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftc10d", "coordinator", "--host", self.host, "--port", str(self.port),
             "--heartbeat-timeout", repr(self.heartbeat_timeout)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True)
        self.pids.add(self.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ftc10d coordinator exited at start (code {self.proc.returncode})")
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"ftc10d coordinator did not listen on {self.address} within {timeout:g} s")

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.proc = None

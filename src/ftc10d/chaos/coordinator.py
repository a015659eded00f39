"""The coordinator store as a process of its own, so that a trial can SIGKILL it for real.

Under ``ftc10d launch`` the coordinator lives inside the launcher; killing it there would
kill the launcher too. For the ``store`` fault the trial runs ``ftc10d coordinator`` as a
child (its own session), points every launcher at it (``LaunchConfig.coordinator``),
SIGKILLs it and restarts it on the same port (from a warm standby: no import delay): the store's state is gone (it is in
memory), the members notice the new incarnation, rejoin and re-form with a fresh uuid.
For the ``store_stop`` fault it SIGSTOPs it instead and SIGCONTs it later (state kept).
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
    """The coordinator on ``host:port``: :meth:`start`, :meth:`kill`, :meth:`start` again.

    Each start promotes a *standby*: a process that has already imported torch and ftc10d
    (seconds on a busy machine) and waits for a line on stdin before it binds the port, so
    that a restart takes milliseconds and the downtime is the one the schedule asked for.
    """

    def __init__(self, host: str, heartbeat_timeout: float, env: dict[str, str]) -> None:
        self.host = host
        self.port = free_port(host)
        self.heartbeat_timeout = heartbeat_timeout
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        #: Stopped by :meth:`freeze` (the ``store_stop`` fault) and not continued yet.
        self.frozen = False
        self._standby: Optional[subprocess.Popen] = None
        self.pids: set[int] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftc10d.chaos.coordinator", self.host, str(self.port),
             repr(self.heartbeat_timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True)
        self.pids.add(proc.pid)
        return proc

    def start(self, timeout: float = 60.0) -> None:
        proc = self._standby or self._spawn()
        self._standby = None
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        self.proc = proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                self._standby = self._spawn()  # warm for the next restart
                return
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the coordinator exited at start (code {proc.returncode})")
                time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"the coordinator did not listen on {self.address} within {timeout:g} s")

    def kill(self) -> None:
        """SIGKILL the running coordinator (its state is lost with it)."""
        self.proc = _killpg(self.proc)
        self.frozen = False

    def freeze(self) -> Optional[int]:
        """SIGSTOP the running coordinator (its state stays; its clients' calls block). Returns
        its pid, or None if none is running (a ``store`` fault's downtime)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None
        self.frozen = True
        return self.proc.pid

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped (a no-op otherwise)."""
        if self.frozen and self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.frozen = False

    def close(self) -> None:
        self.thaw()
        self.kill()
        self._standby = _killpg(self._standby)


def _killpg(proc: Optional[subprocess.Popen]) -> None:
    if proc is None:
        return None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    if proc.stdin is not None:
        proc.stdin.close()
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ftc10d.chaos.coordinator HOST PORT HEARTBEAT_TIMEOUT``: import everything,
    wait for a line on stdin, then host the coordinator until killed."""
    import threading

    from ftc10d.membership import tcp

    host, port, hb = (argv or sys.argv[1:])[:3]
    if not sys.stdin.readline():
        return 0  # the trial went away before needing this standby
    tcp.Coordinator(host, int(port), detect=True, heartbeat_timeout=float(hb)).start()
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The launcher's process plumbing: how a child is started, watched, signalled and reaped.

Kept apart from :mod:`ftc10d.launch.supervisor`, which holds the policy (which slot to
respawn, from a spare or cold, when to give up). What lives here is what makes a child
safe to lose track of:

- **It dies with the launcher.** ``PR_SET_PDEATHSIG = SIGKILL`` is set in the child
  before it runs the worker; it fires when the *thread* that forked the child exits,
  which is why the supervisor forks from its one long-lived thread. A launcher that died
  between ``fork`` and ``prctl`` is caught by re-checking the parent.
- **It leads its own process group**, so a stop reaches whatever the worker started
  (data-loader processes, a compiler), and nothing of the launcher's.
- **Its death is an event, not a poll**: a pidfd per child (Linux >= 5.3) that the
  supervisor's ``poll()`` wakes on; ``None`` where the kernel has none (then the
  supervisor polls ``waitpid``).
- **It is reaped exactly once**, here, with ``Popen.returncode`` set so that
  :class:`subprocess.Popen` never reaps the pid again (it may be reused by then).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

_PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Optional[Callable[..., int]]:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def child_setup(parent: int) -> Callable[[], None]:
    """The children's ``preexec_fn``: die with the launcher (``parent``), lead an own
    process group."""

    def setup() -> None:
        os.setpgid(0, 0)
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def pidfd(pid: int) -> Optional[int]:
    """A pidfd for ``pid`` (readable once it exits), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None


def signal_name(returncode: int) -> Optional[str]:
    """``"SIGKILL"`` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass
class Proc:
    """One child: a worker of a slot, or a spare waiting for one."""

    popen: subprocess.Popen
    pidfd: Optional[int]
    slot: Optional[int]  # None: a spare
    restart: int = 0
    warm: bool = False
    started: float = field(default_factory=time.monotonic)
    control: Optional[int] = None  # spare: write end of its control pipe
    ready_fd: Optional[int] = None  # spare: read end of its readiness pipe
    ready: bool = False
    files: list[Any] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid


def reap(proc: Proc, block: bool) -> Optional[int]:
    """The child's exit code (negative: the signal) once it has exited, None while it runs
    (``block=False``). Closes its pidfd and log files."""
    try:
        pid, status = os.waitpid(proc.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        pid, status = proc.pid, 0
    if pid == 0:
        return None
    rc = os.waitstatus_to_exitcode(status)
    proc.popen.returncode = rc  # reaped here: Popen must not try again
    if proc.pidfd is not None:
        os.close(proc.pidfd)
        proc.pidfd = None
    for f in proc.files:
        f.close()
    return rc


def killpg(proc: Proc, sig: int) -> None:
    """Signal the child's process group; a group already gone is not an error."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    except OSError as exc:  # pragma: no cover - e.g. the group is gone
        if exc.errno != errno.ESRCH:
            raise

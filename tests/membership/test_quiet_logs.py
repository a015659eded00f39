"""Waiting is normal operation, not a warning (issue 14, item 4).

torch's TCPStore client logs two C10D warnings ("waitForInput ... timed out after
5000ms") every time a ``wait`` with a client timeout expires. A member used to watch
for the next configuration in 5-s slices, and a rendezvous waited in 0.25-s slices:
every member printed those lines every few seconds for as long as its job ran, and
many per second while a rendezvous waited for a late member. The script below runs a
coordinator, members that sit idle for many watch slices, a joiner admitted later, and
(in another pair of processes) a rendezvous whose second member arrives 1.5 s late; the
test reads their stderr, where torch's C++ logging goes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import threading, time
    from datetime import timedelta
    import torch.distributed as dist
    import ftc10d
    import ftc10d.membership.background as member_mod
    from ftc10d.membership import Coordinator, Member, TCPMembershipStore

    member_mod.WAIT_SLICE = 0.3  # many watch slices in a short test

    def wait_size(m, n):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            cfg = m.current()
            if cfg is not None and cfg.size == n:
                return cfg
            time.sleep(0.02)
        raise SystemExit(f"no configuration of size {n}")

    co = Coordinator(heartbeat_timeout=1.0).start()
    make = lambda h: Member(TCPMembershipStore("127.0.0.1", co.port), h, heartbeat_timeout=1.0)
    a = make("ftc10d/v1/test/1/a").join()
    wait_size(a, 1)
    time.sleep(2.0)                      # idle: about 7 watch slices
    b = make("ftc10d/v1/test/1/b").join()  # a joiner, admitted into a new configuration
    wait_size(a, 2)
    wait_size(b, 2)
    time.sleep(1.0)

    b.close(leave=True)
    wait_size(a, 1)
    a.close()
    co.close()
    print("DONE", flush=True)
    """
)

RENDEZVOUS = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    import ftc10d

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    pg = ftc10d.ProcessGroup(store, rank, 2, timeout=timedelta(seconds=20), enable_reconfigure=True)
    store.set(f"h/{rank}", pg.get_reconfigure_handle())
    handles = [store.get(f"h/{r}").decode() for r in range(2)]
    time.sleep(0.3 + 1.5 * rank)  # the second member comes 1.5 s after the first
    ftc10d.reconfigure(1, handles, group=pg)
    print("DONE", flush=True)
    """
)


def _env() -> dict[str, str]:
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _store_timeouts(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "waitForInput" in line or "timed out after" in line]


@pytest.mark.timeout(120)
def test_idle_members_joins_and_a_late_rendezvous_log_no_store_timeouts() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    noisy = _store_timeouts(proc.stderr)
    assert not noisy, f"{len(noisy)} store-timeout warnings, e.g.:\n" + "\n".join(noisy[:6])


@pytest.mark.timeout(120)
def test_a_rendezvous_waiting_for_a_late_member_logs_no_store_timeouts() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-c", RENDEZVOUS, str(r), str(server.port)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "DONE" in out, out[-2000:] + err[-4000:]
    noisy = _store_timeouts(outs[0][1])
    assert not noisy, f"the first member logged {len(noisy)} store-timeout warnings, e.g.:\n" + "\n".join(noisy[:6])

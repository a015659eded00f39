"""A process exits cleanly after ``destroy_process_group()`` (invariant 7, issue 25).

Two real processes: ``init_process_group("ftc10d")`` (env://), an all-reduce, a barrier,
``destroy_process_group()``, ``sys.exit(0)``. The destroy retires the group's Gloo backend on
a daemon thread (its destructor may block); the interpreter used to finalize while that thread
was still in the C++ destructor, and killing it there aborted the process ("terminate called
without an active exception", SIGABRT, 8 of 9 runs). Each run must exit 0 on both ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch, torch.distributed as dist
import ftc10d  # registers the backend
dist.init_process_group(sys.argv[1])
t = torch.ones(4)
dist.all_reduce(t)
dist.barrier()
assert t[0].item() == dist.get_world_size(), t
dist.destroy_process_group()
sys.exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("run", range(4))
def test_a_script_exits_0_after_destroy_process_group(run: int) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, "ftc10d"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}: {err[-3000:]}"
        assert "terminate called" not in err, err[-3000:]

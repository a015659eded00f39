"""Shared plumbing for the benchmarks: spawn ranks, host the store, summarise numbers.

Why a copy of ``tests/harness.py``'s approach rather than an import of it: the
benchmarks must run from a bare checkout without the test tree. Workers are
forked from a forkserver that has already imported torch and ftc10d (fast
start-up, and no inherited threads from the parent), and the ``TCPStore`` is
hosted by the parent, so stopping or killing a rank never takes the store down.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "ftc10d"])

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
HAS_NATIVE_RECONFIGURE: bool = hasattr(torch._C._distributed_c10d, "ReconfigureOptions")


# ----------------------------------------------------------------- processes


def die_with_parent() -> None:
    """``preexec_fn`` of a helper process (a coordinator, etcd, an agents' host): it is
    SIGKILLed when the benchmark that started it dies, even by a signal that skips its
    ``finally`` (``timeout``, Ctrl-C twice); an orphaned coordinator goes on polling a dead
    job's heartbeats and skews every later measurement on the machine."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def host_store() -> dist.TCPStore:
    """The parent's store: it outlives every rank (as in the launcher)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))


def client_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    code = 0
    try:
        q.put((rank, "ok", fn(rank, world, port, *args)))
    except BaseException as exc:  # report everything; the parent decides
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        code = 1
    q.close()
    q.join_thread()
    # Hard exit: Gloo threads of aborted (or natively stuck) groups may linger in teardown.
    os._exit(code)


@dataclass
class Job:
    """A set of running ranks and the queue they report on."""

    procs: list[Any]
    queue: Any
    store: dist.TCPStore
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def pid(self, rank: int) -> int:
        return int(self.procs[rank].pid)

    def collect(self, timeout: float = 300.0) -> dict[int, Any]:
        """Wait for every rank's result; raise if one failed or went silent."""
        want = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while not want <= (set(self.results) | set(self.errors)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(want - set(self.results) - set(self.errors))} did not report")
            try:
                rank, status, value = self.queue.get(timeout=min(left, 1.0))
            except Exception:
                dead = [r for r in want - set(self.results) - set(self.errors)
                        if self.procs[r].exitcode not in (None, 0)]
                if dead and self.queue.empty():
                    raise RuntimeError(f"rank(s) {dead} exited without reporting "
                                       f"(exit codes {[self.procs[r].exitcode for r in dead]})")
                continue
            (self.results if status == "ok" else self.errors)[rank] = value
        if self.errors:
            raise RuntimeError("worker(s) failed:\n"
                               + "\n".join(f"[rank {r}] {e}" for r, e in sorted(self.errors.items())))
        return dict(sorted(self.results.items()))

    def close(self) -> None:
        """Kill every rank this job started (a stopped one is continued first so it can die)."""
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(5)


def start(fn: Callable[..., Any], world: int, *args: Any, store: Optional[dist.TCPStore] = None) -> Job:
    """Start ``world`` ranks running ``fn(rank, world, store_port, *args)``."""
    store = store or host_store()
    q = _CTX.Queue()
    procs = [_CTX.Process(target=_entry, args=(fn, r, world, store.port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return Job(procs, q, store)


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> dict[int, Any]:
    job = start(fn, world, *args)
    try:
        return job.collect(timeout=timeout)
    finally:
        job.close()


# ------------------------------------------------------------ in-rank helpers


def store_barrier(store: dist.Store, name: str, world: int) -> None:
    """Meet all ``world`` ranks through the store (outside any timed region)."""
    if store.add(f"bar/{name}", 1) == world:
        store.set(f"bar/{name}/go", "1")
    store.wait([f"bar/{name}/go"])


def exchange(store: dist.Store, name: str, rank: int, world: int, value: str) -> list[str]:
    """All-gather one string per rank through the store, in rank order."""
    store.set(f"x/{name}/{rank}", value)
    keys = [f"x/{name}/{r}" for r in range(world)]
    store.wait(keys)
    return [v.decode() for v in store.multi_get(keys)]


def gloo_backend(store: dist.Store, rank: int, world: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A raw ``ProcessGroupGloo`` built exactly as ftc10d builds its inner one
    (same options, one default device), so a comparison isolates ftc10d's layer."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc ('T' once SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop")
        time.sleep(0.002)


# ------------------------------------------------------------------- numbers


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); fine for a handful of samples."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain Markdown table (pastes straight into docs/benchmarks.md)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def machine() -> str:
    return (f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def dump_json(path: Optional[str], payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
        print(f"wrote {path}")

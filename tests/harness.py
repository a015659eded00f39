"""Multi-process test harness: real processes, a real TCPStore, real signals.

Workers are forked from a forkserver that has already imported torch and
ftc10d, so a 4-rank test starts in tens of milliseconds instead of seconds.
The TCPStore is hosted by the test process itself (as the launcher does), so
killing any rank never takes the store down.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

import ftc10d

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "ftc10d", "tests.harness"])


def host_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def client_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def init_default_group(backend: str, rank: int, world: int, port: int, timeout: timedelta) -> None:
    """The default group on ``backend`` ("gloo": torch's own, "ftc10d": ours), for tests that
    hold an ftc10d group to what torch's Gloo group does on the same calls."""
    store = dist.PrefixStore(backend, client_store(port))
    if backend == "ftc10d":
        ftc10d.init_process_group(store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = 0
    try:
        result = fn(rank, world, port, *args)
        q.put((rank, "ok", result))
    except BaseException as exc:  # report everything, the test decides
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        code = 1
    q.close()
    q.join_thread()  # flush before the hard exit below
    # Hard exit: skip interpreter teardown, where Gloo threads of aborted groups may linger.
    os._exit(code)


@dataclass
class Job:
    procs: list[Any]
    queue: Any
    store: dist.TCPStore
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.store.port

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def collect(self, ranks: Optional[list[int]] = None, timeout: float = 120.0) -> dict[int, Any]:
        """Wait for the results of ``ranks`` (default all); raise if any of them failed."""
        want = set(range(len(self.procs)) if ranks is None else ranks)
        deadline = time.monotonic() + timeout
        while not want <= (set(self.results) | set(self.errors)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(want - set(self.results) - set(self.errors))} did not report")
            try:
                rank, status, value = self.queue.get(timeout=min(left, 1.0))
            except Exception:
                continue
            (self.results if status == "ok" else self.errors)[rank] = value
        bad = {r: e for r, e in self.errors.items() if r in want}
        if bad:
            raise AssertionError("worker(s) failed:\n" + "\n".join(f"[rank {r}] {e}" for r, e in sorted(bad.items())))
        return {r: self.results[r] for r in sorted(want)}

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(5)


def start(fn: Callable[..., Any], world: int, *args: Any, store: Optional[dist.TCPStore] = None) -> Job:
    store = store or host_store()
    q = _CTX.Queue()
    procs = [_CTX.Process(target=_entry, args=(fn, r, world, store.port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return Job(procs, q, store)


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> dict[int, Any]:
    job = start(fn, world, *args)
    try:
        return job.collect(timeout=timeout)
    finally:
        job.close()


def exchange(store: dist.Store, tag: str, index: int, value: str, count: int) -> list[str]:
    """All-gather a string through the store (the out-of-band exchange of handles)."""
    store.set(f"test/{tag}/{index}", value)
    keys = [f"test/{tag}/{i}" for i in range(count)]
    store.wait(keys, timedelta(seconds=60))
    return [v.decode() for v in store.multi_get(keys)]


def store_barrier(store: dist.Store, tag: str, index: int, count: int) -> None:
    exchange(store, tag, index, "1", count)

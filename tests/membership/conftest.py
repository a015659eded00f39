"""Fixtures of the membership tests: a real coordinator (TCPStore) or a real etcd."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator, Optional

import pytest
import torch.distributed as dist

from ftc10d.membership import Coordinator
from ftc10d.chaos.etcd import ETCD, SKIP_REASON, EtcdCluster

needs_etcd = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)



@pytest.fixture
def etcd1() -> Iterator[EtcdCluster]:
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def tcp_spec(co: Coordinator, **extra: Any) -> dict[str, Any]:
    return {"kind": "tcp", "host": co.host, "port": co.port, **extra}


def etcd_spec(cluster: EtcdCluster, **extra: Any) -> dict[str, Any]:
    return {"kind": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{time.monotonic_ns()}/", **extra}


def states(store: dist.Store, ranks: list[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for r in ranks:
        key = f"test/state/{r}"
        if store.check([key]):
            out[r] = json.loads(store.get(key))
    return out


def wait_states(store: dist.Store, ranks: list[int], pred: Callable[[dict[int, dict[str, Any]]], bool],
                timeout: float, what: str) -> dict[int, dict[str, Any]]:
    """Poll the ranks' published states until ``pred`` holds; fail with the last states."""
    deadline = time.monotonic() + timeout
    last: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        last = states(store, ranks)
        if len(last) == len(ranks) and pred(last):
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; states: {json.dumps(last, indent=1)}")


def same_config(st: dict[int, dict[str, Any]], size: int, min_steps: int = 0,
                not_uuid: Optional[int] = None) -> bool:
    uuids = {s.get("uuid") for s in st.values()}
    return (len(uuids) == 1 and None not in uuids and not_uuid not in uuids
            and all(s.get("size") == size and s.get("steps", 0) >= min_steps for s in st.values()))


def beat_links(links: list[tuple[Any, str]], done: Any, every: float = 0.1) -> None:
    """Beat each rank's node agent over its real local link (``(NodeLink, member id)``) every
    ``every`` seconds until ``done`` is set, on a thread: ranks that stay alive while only
    their agents are frozen."""
    import threading

    def run() -> None:
        n = 0
        while not done.wait(every):
            n += 1
            for link, mid in links:
                link.beat(n, mid, timeout=0.0)

    threading.Thread(target=run, daemon=True).start()


class LastBeat:
    """When a node's heartbeat record last changed in the store (``time.monotonic``), seen by
    polling it every 2-3 ms on a thread of its own: the start of a silence, for the tests that
    time a removal from it (a context manager; ``at`` once it exits)."""

    def __init__(self, open_store: Callable[[], Any], unit: str) -> None:
        import threading

        from ftc10d.membership.agreement import hb_key

        self.at = time.monotonic()
        self._stop = threading.Event()
        self._key = hb_key(unit)
        self._open = open_store
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        own = self._open()
        prev = own.get(self._key)
        while not self._stop.is_set():
            raw = own.get(self._key)
            if raw is not None and raw != prev:
                prev, self.at = raw, time.monotonic()
            time.sleep(0.002)

    def __enter__(self) -> "LastBeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

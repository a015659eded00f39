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

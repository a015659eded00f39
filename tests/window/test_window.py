"""One-sided windows: put / signal / wait_signal / map_remote_tensor, on shared memory
and on the TCP path, with their error cases and their behaviour under faults.

Real processes, a real TCPStore hosted by the test process, real SIGKILL.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch

import ftc10d
from ftc10d import _compat
from tests import harness

T = timedelta(seconds=20)
TRANSPORTS = ["auto", "tcp"]  # auto = shared memory between these same-host ranks


def _pattern(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int64) * (rank + 2) + salt
    if dtype == torch.bool:
        return (base % 3 == 0)
    if dtype == torch.uint8:
        return (base % 251).to(dtype)
    return base.to(dtype)


def _group(rank: int, world: int, port: int, transport: str) -> ftc10d.ProcessGroup:
    os.environ["FTC10D_WINDOW_TRANSPORT"] = transport
    store = harness.client_store(port)
    return ftc10d.ProcessGroup(store, rank, world, timeout=T)


# ----------------------------------------------------------------------- ring


RING_CASES = [
    (torch.float32, 1), (torch.float32, 16), (torch.float64, 1 << 17), (torch.bfloat16, 1000),
    (torch.int64, 4096), (torch.uint8, (1 << 20) + 3), (torch.bool, 77), (torch.complex64, 256),
]


def _ring(rank: int, world: int, port: int, transport: str) -> dict:
    pg = _group(rank, world, port, transport)
    hooks: list[tuple[str, object]] = []
    pg.register_pre_hook(1, lambda a: hooks.append(("pre", a.name)))
    pg.register_post_hook(2, lambda a: hooks.append(("post", a.name)))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out: dict = {"hooks_ok": None, "cases": [], "buffered": None}

    win = pg.new_window()  # registered below, once per dtype/size (tensor_register is collective)
    out["hooks_ok"] = hooks == [("pre", ftc10d.HookOpName.NEW_WINDOW), ("post", ftc10d.HookOpName.NEW_WINDOW)]
    out["supports_window"] = pg.supports_window
    out["attr"] = [str(win.get_attr(r).access_type).rsplit(".", 1)[-1] for r in range(world)]
    for dtype, n in RING_CASES:
        local = torch.zeros(2 * n, dtype=dtype)
        win.tensor_register(local)
        for async_op in (False, True):
            salt = 7 if async_op else 0
            mine = _pattern(rank, n, dtype, salt)
            off = n if async_op else 0  # sync fills the first half, async the second
            w_put = win.put(mine, nxt, off, async_op)
            w_sig = win.signal(nxt, async_op)
            w_wait = win.wait_signal(prv, async_op)
            if async_op:
                w_wait.wait()
                assert w_put.is_completed() and w_sig.is_completed()  # stream order: before the wait
            got = local[off:off + n]
            ok = torch.equal(got, _pattern(prv, n, dtype, salt))
            out["cases"].append((str(dtype), n, async_op, ok))
        if transport == "auto":
            # a real view of the next rank's memory: it holds what we put there
            remote = win.map_remote_tensor(nxt)
            out.setdefault("mapped", []).append(
                bool(torch.equal(remote[:n], _pattern(rank, n, dtype)))
                and remote.shape == local.shape and remote.dtype == dtype
            )
        assert win.map_remote_tensor(rank) is local
        harness.store_barrier(pg.generation.store, f"dereg-{dtype}-{n}", rank, world)  # nobody still reads
        win.tensor_deregister()

    # extra signals stay buffered: 3 signals, then 3 waits, none blocks
    win.tensor_register(torch.zeros(4))
    for _ in range(3):
        win.signal(nxt, False)
    t0 = time.perf_counter()
    for _ in range(3):
        win.wait_signal(prv, False)
    out["buffered"] = time.perf_counter() - t0 < 5.0
    # a signal to oneself, and a put to oneself
    win.put(torch.full((4,), 5.0), rank, 0, False)
    win.signal(rank, False)
    win.wait_signal(rank, False)
    out["self"] = win.map_remote_tensor(rank).tolist()
    if transport == "tcp":
        with pytest.raises(ftc10d.WindowUsageError, match="SEPARATE"):
            win.map_remote_tensor(nxt)
    # futures follow the op
    w = win.signal(nxt, True)
    fut = win.wait_signal(prv, True).get_future()
    fut.wait()
    out["future"] = w.wait() and fut.done()
    harness.store_barrier(pg.generation.store, "done", rank, world)
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ring_put_signal_wait(transport: str) -> None:
    res = harness.run(_ring, 3, transport)
    expect = "UNIFIED" if transport == "auto" else "SEPARATE"
    for r, out in res.items():
        assert out["hooks_ok"], "new_window must fire pre/post hooks with HookOpName.NEW_WINDOW"
        assert out["supports_window"] is True
        assert out["attr"] == [expect if q != r else "UNIFIED" for q in range(3)]
        assert len(out["cases"]) == 2 * len(RING_CASES)
        bad = [c for c in out["cases"] if not c[3]]
        assert not bad, f"rank {r}: wrong data for {bad}"
        if transport == "auto":
            assert all(out["mapped"]), f"rank {r}: map_remote_tensor did not show the peer's data"
        assert out["buffered"]
        assert out["self"] == [5.0] * 4
        assert out["future"]


# --------------------------------------------------------------------- errors


def _errors(rank: int, world: int, port: int) -> dict:
    pg = _group(rank, world, port, "auto")
    peer = 1 - rank
    caught: dict[str, str] = {}

    def expect(name: str, exc: type, fn) -> None:
        try:
            fn()
        except exc as e:
            assert isinstance(e, ftc10d.FTC10DError)
            caught[name] = str(e)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")

    os.environ["FTC10D_WINDOW_TRANSPORT"] = "bogus"
    expect("bad_env", ftc10d.InvalidOptionError, lambda: pg.new_window())
    os.environ["FTC10D_WINDOW_TRANSPORT"] = "auto"
    expect("non_contiguous_new", ftc10d.WindowUsageError, lambda: pg.new_window(torch.zeros(4, 4).t()))
    win = pg.new_window()
    expect("put_unregistered", ftc10d.WindowNotRegisteredError, lambda: win.put(torch.ones(4), peer, 0, False))
    expect("map_unregistered", ftc10d.WindowNotRegisteredError, lambda: win.map_remote_tensor(peer))
    expect("dereg_unregistered", ftc10d.WindowNotRegisteredError, lambda: win.tensor_deregister())
    expect("non_contiguous", ftc10d.WindowUsageError, lambda: win.tensor_register(torch.zeros(4, 4).t()))
    expect("not_a_tensor", ftc10d.WindowUsageError, lambda: win.tensor_register([1.0, 2.0]))
    local = torch.zeros(16)
    win.tensor_register(local)
    expect("double_register", ftc10d.WindowAlreadyRegisteredError, lambda: win.tensor_register(torch.zeros(16)))
    expect("bounds", ftc10d.WindowBoundsError, lambda: win.put(torch.ones(16), peer, 8, False))
    expect("bounds_async", ftc10d.WindowBoundsError, lambda: win.put(torch.ones(16), peer, 8, True))
    expect("negative_offset", ftc10d.WindowBoundsError, lambda: win.put(torch.ones(1), peer, -1, False))
    expect("too_big", ftc10d.WindowBoundsError, lambda: win.put(torch.ones(17), peer, 0, False))
    expect("dtype", ftc10d.WindowDtypeError, lambda: win.put(torch.ones(4, dtype=torch.float64), peer, 0, False))
    expect("rank_put", ftc10d.WindowRankError, lambda: win.put(torch.ones(4), world, 0, False))
    expect("rank_signal", ftc10d.WindowRankError, lambda: win.signal(-1, False))
    expect("rank_wait", ftc10d.WindowRankError, lambda: win.wait_signal(5, True))
    expect("rank_map", ftc10d.WindowRankError, lambda: win.map_remote_tensor(3))
    expect("rank_attr", ftc10d.WindowRankError, lambda: win.get_attr(7))
    expect("rank_type", ftc10d.WindowUsageError, lambda: win.signal("1", False))
    expect("offset_type", ftc10d.WindowUsageError, lambda: win.put(torch.ones(1), peer, 1.5, False))
    expect("put_not_tensor", ftc10d.WindowUsageError, lambda: win.put([1.0], peer, 0, False))
    bad_opts = ftc10d.PutOptions()
    bad_opts.hints = {"nope": "1"}
    expect("hints", ftc10d.InvalidOptionError, lambda: win.put(torch.ones(1), peer, 0, False, bad_opts))
    expect("opts_type", ftc10d.InvalidOptionError, lambda: win.signal(peer, False, 3))
    # nothing above broke the window: a 16-element put at offset 0 fits
    opts = ftc10d.PutOptions()
    opts.timeout = timedelta(seconds=5)
    win.put(torch.arange(16.0) + rank, peer, 0, False, opts)
    win.signal(peer, False, ftc10d.SignalOptions())
    win.wait_signal(peer, False, ftc10d.WaitSignalOptions())
    caught["works_after"] = str(local.tolist() == (torch.arange(16.0) + peer).tolist())
    harness.store_barrier(pg.generation.store, "done", rank, world)
    return caught


def test_every_error_is_typed_and_explained() -> None:
    res = harness.run(_errors, 2)
    for r, caught in res.items():
        assert caught.pop("works_after") == "True"
        assert "offset 8" in caught["bounds"] and "offsets 0..0 fit" in caught["bounds"]
        assert "16 element(s)" in caught["bounds"]
        assert "tensor_register" in caught["put_unregistered"]
        assert "tensor_deregister()" in caught["double_register"]
        assert "torch.float64" in caught["dtype"] and "torch.float32" in caught["dtype"]
        assert "valid ranks are 0..1" in caught["rank_put"]
        assert "contiguous" in caught["non_contiguous"]
        assert "FTC10D_WINDOW_TRANSPORT" in caught["bad_env"]
        assert "hints" in caught["hints"]


# ----------------------------------------------------------- invalid windows


def _ring_once(win, rank: int, world: int, local: torch.Tensor, value: float) -> bool:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    win.put(torch.full((4,), value + rank), nxt, 0, False)
    win.signal(nxt, False)
    win.wait_signal(prv, False)
    return local[:4].tolist() == [value + prv] * 4


def _invalidation(rank: int, world: int, port: int, transport: str) -> dict:
    pg = _group(rank, world, port, transport)
    root = harness.client_store(port)
    handles = harness.exchange(root, "h", rank, pg.get_reconfigure_handle(), world)
    out: dict = {}
    local = torch.zeros(8)
    win = pg.new_window(local)
    idle = pg.new_window(torch.zeros(8))
    out["before"] = _ring_once(win, rank, world, local, 10.0)
    pending = idle.wait_signal((rank + 1) % world, True)  # nobody will signal it

    # reconfigure (same members, fresh uuid): both windows die with their generation
    t0 = time.perf_counter()
    ftc10d.reconfigure(1, handles, group=pg)
    try:
        pending.wait()
        out["pending"] = "completed"
    except ftc10d.WindowInvalidError:
        out["pending"] = ("WindowInvalidError", time.perf_counter() - t0)
    for name, fn in {
        "put": lambda: win.put(torch.ones(4), 0, 0, False),
        "signal": lambda: win.signal(0, False),
        "wait_signal": lambda: win.wait_signal(0, False),
        "map": lambda: win.map_remote_tensor(0),
        "register": lambda: idle.tensor_register(torch.zeros(2)),
    }.items():
        try:
            fn()
            out[name] = "no error"
        except ftc10d.WindowInvalidError as e:
            out[name] = str(e)
            assert isinstance(e, ftc10d.ProcessGroupAborted) and \
                e.op == name.replace("map", "map_remote_tensor").replace("register", "tensor_register")
    # a new window of the new configuration works
    local2 = torch.zeros(8)
    win2 = pg.new_window(local2)
    out["after"] = _ring_once(win2, rank, world, local2, 20.0)
    out["uuid"] = win2.uuid

    # abort(): a pending wait raises at once, and later ops raise
    pending = win2.wait_signal((rank + 1) % world, True)
    harness.store_barrier(root, "before-abort", rank, world)
    timer = threading.Timer(0.2, pg.abort)
    t0 = time.perf_counter()
    timer.start()
    try:
        pending.wait()
        out["abort_pending"] = "completed"
    except ftc10d.WindowInvalidError as e:
        out["abort_pending"] = ("WindowInvalidError", time.perf_counter() - t0, e.uuid)
    timer.join()
    try:
        win2.put(torch.ones(4), 0, 0, False)
        out["after_abort"] = "no error"
    except ftc10d.WindowInvalidError as e:
        out["after_abort"] = str(e)
    with pytest.raises(ftc10d.ProcessGroupAborted):
        pg.new_window()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_windows_invalid_after_reconfigure_and_abort(transport: str) -> None:
    res = harness.run(_invalidation, 3, transport)
    for r, out in res.items():
        assert out["before"] and out["after"]
        kind, dt = out["pending"]
        assert kind == "WindowInvalidError" and dt < 5.0
        for name in ("put", "signal", "wait_signal", "map", "register"):
            assert "no longer valid" in out[name] and "reconfigured" in out[name], out[name]
            assert "new_window()" in out[name]
        assert out["uuid"] == 1
        kind, dt, uuid = out["abort_pending"]
        assert kind == "WindowInvalidError" and uuid == 1
        assert dt < 0.2 + 2.0, f"wait_signal took {dt:.2f} s to notice abort()"
        assert "aborted by the user" in out["after_abort"]


# -------------------------------------------------------------- peer aborts


def _peer_aborts(rank: int, world: int, port: int, transport: str) -> dict:
    """Rank 0 aborts alone. Rank 1's put into it is refused (nothing lands in rank 0's
    tensor); rank 2, asleep waiting for rank 0's signal, learns that it will never come."""
    pg = _group(rank, world, port, transport)
    root = harness.client_store(port)
    local = torch.zeros(8)
    win = pg.new_window(local)
    pending = win.wait_signal(0, True) if rank == 2 else None
    harness.store_barrier(root, "ready", rank, world)
    if rank == 0:
        pg.abort()
        root.set("r0-aborted", "1")
        harness.store_barrier(root, "done", rank, world)  # stay alive: this is an abort, not a death
        return {"local": local.tolist()}
    root.wait(["r0-aborted"], timedelta(seconds=30))
    t0 = time.perf_counter()
    try:
        if rank == 1:
            win.put(torch.ones(8), 0, 0, False)
        else:
            assert pending is not None
            pending.wait()
        out = {"error": None}
    except ftc10d.WindowInvalidError as e:
        out = {"error": (type(e).__name__, e.peer, str(e), time.perf_counter() - t0)}
    deadline = time.monotonic() + 5.0  # an async op's failure aborts on a thread of its own
    while not pg.generation.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    out["aborted_too"] = pg.generation.aborted
    harness.store_barrier(root, "done", rank, world)
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_abort_refuses_puts_and_ends_waits(transport: str) -> None:
    res = harness.run(_peer_aborts, 3, transport)
    assert res[0]["local"] == [0.0] * 8, "a put landed in an aborted window"
    for r in (1, 2):
        assert res[r]["error"] is not None, f"rank {r}: no error"
        kind, peer, text, dt = res[r]["error"]
        assert kind == "WindowInvalidError" and peer == 0, text
        assert "peer rank 0 aborted" in text and "aborted by the user" in text, text
        assert dt < 3.0
        assert res[r]["aborted_too"], "a peer's abort must abort this rank's configuration too"


# ---------------------------------------------------------------- SIGKILL


def _shm_mappings() -> list[tuple[int, str]]:
    """(inode, path) of this process's shared-memory mappings made by windows."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and ("ftc10d-window" in parts[5] or "/torch_" in parts[5]):
                out.append((int(parts[4]), parts[5].strip()))
    return sorted(set(out))


def _killed(rank: int, world: int, port: int, transport: str) -> dict:
    if transport == "tcp":
        # as across hosts: no pidfd on the peer, its death must be seen on the network
        from ftc10d.window import _shm

        _shm.PidWatch.exited = lambda self: False  # type: ignore[method-assign]
    pg = _group(rank, world, port, transport)
    root = harness.client_store(port)
    handles = harness.exchange(root, "h", rank, pg.get_reconfigure_handle(), world)
    victim = world - 1
    local = torch.zeros(1 << 20)  # 4 MiB
    win = pg.new_window(local)
    for q in range(world):  # connect every pair (the TCP path connects lazily)
        if q != rank:
            win.signal(q, False)
    for q in range(world):
        if q != rank:
            win.wait_signal(q, False)
    # this rank's own segments: its signal block and its tensor's storage
    own = {win._res.own.inode}
    if transport == "auto":
        own.add(os.fstat(local.untyped_storage()._share_fd_cpu_()[0]).st_ino)
    assert own <= {i for i, _ in _shm_mappings()}
    harness.exchange(root, "maps", rank, ";".join(str(i) for i in own), world)
    if rank == victim:
        root.set("victim", str(os.getpid()))
        time.sleep(60)  # killed by the test meanwhile
        return {}
    out: dict = {}
    mine_before = {i for i, _ in _shm_mappings()}
    t0 = time.perf_counter()
    try:
        win.wait_signal(victim, False)  # never comes: the victim is killed
        out["wait"] = "completed"
    except ftc10d.PeerFailureError as e:
        out["wait"] = ("PeerFailureError", e.peer, time.perf_counter() - t0)
    victim_inodes = {int(i) for i in root.get(f"test/maps/{victim}").decode().split(";") if i}
    survivors = [h for i, h in enumerate(handles) if i != victim]
    ftc10d.reconfigure(1, survivors, group=pg)
    with pytest.raises(ftc10d.WindowInvalidError):
        win.put(torch.ones(1), 0, 0, False)
    del win
    gc.collect()
    local2 = torch.zeros(1 << 10)
    win2 = pg.new_window(local2)
    out["after"] = _ring_once(win2, pg.rank(), pg.size(), local2, 30.0)
    mine_after = {i for i, _ in _shm_mappings()}
    out["victim_was_mapped"] = bool(victim_inodes & mine_before)
    out["victim_still_mapped"] = sorted(victim_inodes & mine_after)
    harness.store_barrier(root, "done", rank, world - 1)
    return out


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_peer_no_leak(transport: str) -> None:
    before = _dev_shm()
    job = harness.start(_killed, 3, transport)
    try:
        job.store.wait(["victim"], timedelta(seconds=60))
        job.signal(2, signal.SIGKILL)
        res = job.collect([0, 1], timeout=60)
    finally:
        job.close()
    for r, out in res.items():
        kind, peer, dt = out["wait"]
        assert kind == "PeerFailureError" and peer == 2
        assert dt < 5.0, f"rank {r} took {dt:.2f} s to see the death"
        assert out["after"]
        if transport == "auto":
            assert out["victim_was_mapped"]  # the test sees what it claims to see
        assert out["victim_still_mapped"] == [], "survivors still map the dead rank's memory"
    leaked = {n for n in _dev_shm() - before if n.startswith(("torch_", "ftc10d"))}
    assert not leaked, f"named shared memory left behind: {sorted(leaked)}"


# --------------------------------------------------------------- torch 2.14


def _native_api(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    pg = _group(rank, world, port, "auto")
    local = torch.zeros(4)
    win = dist._new_window(local, group=pg)
    win.put(torch.full((4,), float(rank)), 1 - rank, 0, False, torch._C._distributed_c10d.PutOptions())
    win.signal(1 - rank, False, torch._C._distributed_c10d.SignalOptions())
    win.wait_signal(1 - rank, False, torch._C._distributed_c10d.WaitSignalOptions())
    attr = win.get_attr(1 - rank)
    harness.store_barrier(pg.generation.store, "done", rank, world)
    return {"supports": dist._supports_window(pg), "data": local.tolist(),
            "attr_is_torch": isinstance(attr, torch._C._distributed_c10d.WindowAttr)}


@pytest.mark.skipif(_compat.TorchWindowAttr is None, reason="torch < 2.14 has no native window API")
def test_torch_native_window_api() -> None:
    res = harness.run(_native_api, 2)
    for r, out in res.items():
        assert out == {"supports": True, "data": [float(1 - r)] * 4, "attr_is_torch": True}

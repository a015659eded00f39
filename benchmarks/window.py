"""One-sided window puts vs Gloo send/recv: bandwidth and put->signal->wait latency.

Two ranks. Every measurement is a ping-pong, so it is timed on one clock (rank 0's):

- **bandwidth**: rank 0 ``put``s N bytes into rank 1's window and ``signal``s;
  rank 1 ``wait_signal``s and signals back; rank 0 waits for that. The Gloo
  baseline is the same exchange with ``send``/``recv`` of N bytes and a 4-byte
  ack. Bandwidth = N / iteration time, so the ack's latency is included on
  both sides (it is small next to N = 16 MiB).
- **latency**: 16-byte ping-pong, ``put + signal`` / ``wait_signal`` each way
  vs ``send`` / ``recv`` each way; reported one way (round trip / 2).

Window and Gloo alternate block by block (order rotated every run), and each
figure is the median over ``--runs`` blocks. Paths:

- ``shm``: both ranks on this host, window over shared memory (UNIFIED), Gloo over loopback TCP;
- ``tcp``: the window's TCP path forced (``FTC10D_WINDOW_TRANSPORT=tcp``), over loopback;
- ``netns``: the two ranks in two network namespaces joined by a veth pair that
  the script creates (and deletes), window TCP and Gloo both over the veth. Root
  only; skipped otherwise or with ``--no-netns``.

    python benchmarks/window.py [--sizes 4K,1M,16M,64M] [--runs 7] [--paths shm,tcp,netns] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    dump_json,
    fmt_size,
    gloo_backend,
    machine,
    median,
    parse_size,
    run,
    table,
)

TARGET_RATIO = 5.0  # same-host put >= 5x Gloo send/recv bandwidth at 16 MiB
TARGET_SIZE = 16 << 20
LAT_ELEMS = 4  # 16 bytes of float32
T = timedelta(seconds=120)
NETNS = ("ftc10d-bench-a", "ftc10d-bench-b")
VETH = ("ftc10d-va", "ftc10d-vb")
NET_IPS = ("10.231.7.1", "10.231.7.2")


def _iters(nbytes: int) -> int:
    """Iterations per block: ~50-150 ms per block on a slow machine."""
    if nbytes <= 64 << 10:
        return 300
    if nbytes <= 1 << 20:
        return 60
    if nbytes <= 16 << 20:
        return 8
    return 3


# --------------------------------------------------------------------- ranks


def _pair(rank: int, store: dist.Store, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the benchmark; rank 0's timings are the result."""
    import ftc10d

    torch.set_num_threads(1)
    os.environ["FTC10D_WINDOW_TRANSPORT"] = cfg["transport"]
    if cfg.get("copy_threads"):
        os.environ["FTC10D_WINDOW_COPY_THREADS"] = str(cfg["copy_threads"])
    peer = 1 - rank
    pg = ftc10d.ProcessGroup(dist.PrefixStore("ftc10d", store), rank, 2, timeout=T)
    gloo = gloo_backend(dist.PrefixStore("gloo", store), rank, 2, T)
    sizes = [int(s) for s in cfg["sizes"]]
    max_elems = max(sizes) // 4
    local = torch.zeros(max(max_elems, LAT_ELEMS))
    win = pg.new_window(local)
    attr = str(win.get_attr(peer).access_type).rsplit(".", 1)[-1]
    torch.manual_seed(0)
    src = torch.randn(max_elems)
    ack = torch.zeros(1)
    lat_buf = torch.zeros(LAT_ELEMS)
    gloo_buf = torch.zeros(max_elems)  # apart from the window, so the data check below means something

    def window_bw(n: int, iters: int) -> None:
        data = src[:n]
        for _ in range(iters):
            if rank == 0:
                win.put(data, 1, 0, False)
                win.signal(1, False)
                win.wait_signal(1, False)
            else:
                win.wait_signal(0, False)
                win.signal(0, False)

    def gloo_bw(n: int, iters: int) -> None:
        data = src[:n]
        buf = gloo_buf[:n]
        for _ in range(iters):
            if rank == 0:
                gloo.send([data], 1, 0).wait()
                gloo.recv([ack], 1, 1).wait()
            else:
                gloo.recv([buf], 0, 0).wait()
                gloo.send([ack], 0, 1).wait()

    copy_dst = torch.zeros(max_elems)

    def memcpy_bw(n: int, iters: int) -> None:
        """The floor of a put: one private-to-private copy of n floats on rank 0, nothing
        else (rank 1 stays idle, as it sleeps in wait_signal during a put)."""
        if rank != 0:
            return
        data = src[:n]
        dst = copy_dst[:n]
        for _ in range(iters):
            dst.copy_(data)

    def window_lat(_n: int, iters: int) -> None:
        x = src[:LAT_ELEMS]
        for _ in range(iters):
            if rank == 0:
                win.put(x, 1, 0, False)
                win.signal(1, False)
                win.wait_signal(1, False)
            else:
                win.wait_signal(0, False)
                win.put(x, 0, 0, False)
                win.signal(0, False)

    def gloo_lat(_n: int, iters: int) -> None:
        x = src[:LAT_ELEMS]
        for _ in range(iters):
            if rank == 0:
                gloo.send([x], 1, 0).wait()
                gloo.recv([lat_buf], 1, 1).wait()
            else:
                gloo.recv([lat_buf], 0, 0).wait()
                gloo.send([x], 0, 1).wait()

    def block(fn: Callable[[int, int], None], n: int, iters: int) -> float:
        gloo.barrier().wait()
        t0 = time.perf_counter()
        fn(n, iters)
        return (time.perf_counter() - t0) / iters

    samples: dict[str, list[float]] = {}
    cases: list[tuple[str, Callable[[int, int], None], int, int]] = []
    for nbytes in sizes:
        n = nbytes // 4
        cases.append((f"bw/window/{nbytes}", window_bw, n, _iters(nbytes)))
        cases.append((f"bw/gloo/{nbytes}", gloo_bw, n, _iters(nbytes)))
        cases.append((f"bw/memcpy/{nbytes}", memcpy_bw, n, _iters(nbytes)))
    cases.append(("lat/window", window_lat, LAT_ELEMS, 1000))
    cases.append(("lat/gloo", gloo_lat, LAT_ELEMS, 1000))
    for name, fn, n, iters in cases:  # warm up every path (connections, page faults)
        block(fn, n, max(1, iters // 10))
    for r in range(int(cfg["runs"])):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for name, fn, n, iters in order:
            samples.setdefault(name, []).append(block(fn, n, iters))
    # the data really arrived: rank 1 holds rank 0's last bandwidth put
    ok = True
    if rank == 1:
        ok = bool(torch.equal(local[: max_elems], src[: max_elems]))
    gloo.barrier().wait()
    return {"attr": attr, "samples": samples, "data_ok": ok}


def _forked(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from benchmarks._common import client_store

    return _pair(rank, client_store(port), cfg)


# ------------------------------------------------------------------ netns


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _netns_down() -> None:
    for ns in NETNS:
        _sh("ip", "netns", "del", ns, check=False)  # deletes its end of the veth pair too
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    _sh("ip", "link", "del", VETH[0], check=False)


def _hosts_file(ns: str, ip: str) -> None:
    """Make the hostname resolve to the namespace's veth address inside it.

    Gloo's default device (the one ftc10d and torch use) binds to what the hostname
    resolves to; ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
    ``/etc/hosts`` for the command it runs.
    """
    import socket

    host = socket.gethostname()
    try:
        with open("/etc/hosts") as f:
            lines = [ln for ln in f if host not in ln.split("#")[0].split()[1:]]
    except OSError:
        lines = ["127.0.0.1 localhost\n"]
    os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
    with open(f"/etc/netns/{ns}/hosts", "w") as f:
        f.writelines(lines)
        f.write(f"{ip} {host}\n")


def _netns_up() -> None:
    _netns_down()
    for ns in NETNS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, ip in zip(NETNS, VETH, NET_IPS):
        _sh("ip", "link", "set", veth, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
        _sh("ip", "-n", ns, "link", "set", veth, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _hosts_file(ns, ip)


def netns_available() -> Optional[str]:
    """None if the netns path can run, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    return None


def _run_netns(cfg: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Rank 0 in namespace a (hosting the store), rank 1 in namespace b; results on stdout."""
    _netns_up()
    procs: list[subprocess.Popen] = []
    try:
        port = 29411
        for rank in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=VETH[rank], FTC10D_WINDOW_HOST=NET_IPS[rank],
                       OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
            cmd = ["ip", "netns", "exec", NETNS[rank], sys.executable, str(Path(__file__).resolve()),
                   "--_worker", str(rank), "--_store", f"{NET_IPS[0]}:{port}", "--_cfg", json.dumps(cfg)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600) for p in procs]
        for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"netns rank {rank} failed ({p.returncode}):\n{err[-3000:]}")
        return {rank: json.loads(out.strip().splitlines()[-1]) for rank, (out, _) in enumerate(outs)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        _netns_down()


def _worker_main(rank: int, store_addr: str, cfg: dict[str, Any]) -> None:
    host, _, port = store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), world_size=2, is_master=rank == 0, timeout=T,
                          wait_for_workers=False)
    result = _pair(rank, store, cfg)
    print(json.dumps(result), flush=True)
    if rank == 0:
        # keep hosting the store until rank 1 is done with it
        store.wait(["bye/1"], T)
    else:
        store.set("bye/1", "1")
    os._exit(0)


# ------------------------------------------------------------------- report


def _paired(num: list[float], den: list[float]) -> float:
    """Median over runs of the per-run ratio (both measured in the same interleaved round)."""
    return median([a / b for a, b in zip(num, den)])


def _report(results: dict[str, dict[str, Any]], sizes: list[int]) -> tuple[str, str, list[str]]:
    rows = []
    verdicts = []
    for path, res in results.items():
        s = res["samples"]
        for nbytes in sizes:
            ws, gs, cs = s[f"bw/window/{nbytes}"], s[f"bw/gloo/{nbytes}"], s[f"bw/memcpy/{nbytes}"]
            w, g, c = median(ws), median(gs), median(cs)
            ratio = g / w
            rows.append([path, res["attr"], fmt_size(nbytes), f"{g * 1e6:.1f}", f"{w * 1e6:.1f}", f"{c * 1e6:.1f}",
                         f"{nbytes / g / 1e9:.2f}", f"{nbytes / w / 1e9:.2f}", f"{ratio:.2f}x",
                         f"{_paired(gs, ws):.2f}x", f"{g / c:.2f}x"])
            if path == "shm" and nbytes == TARGET_SIZE:
                verdicts.append(f"target: same-host put >= {TARGET_RATIO:g}x Gloo send/recv bandwidth at 16 MiB: "
                                f"{ratio:.2f}x, {'met' if ratio >= TARGET_RATIO else 'MISSED'} "
                                f"(a bare memcpy of 16 MiB would be {g / c:.2f}x)")
    bw = table(["path", "access", "size", "gloo us/iter", "window us/iter", "memcpy us", "gloo GB/s",
                "window GB/s", "window/gloo bw", "(paired)", "memcpy/gloo bw"], rows)
    lrows = []
    for path, res in results.items():
        s = res["samples"]
        w = median(s["lat/window"]) / 2
        g = median(s["lat/gloo"]) / 2
        lrows.append([path, f"{g * 1e6:.1f}", f"{w * 1e6:.1f}", f"{g / w:.2f}x",
                      f"{_paired(s['lat/gloo'], s['lat/window']):.2f}x"])
    lat = table(["path", "gloo send->recv us (one way)", "window put->signal->wait us (one way)",
                 "gloo/window", "(paired)"], lrows)
    return bw, lat, verdicts


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,1M,16M,64M", help="comma-separated put sizes (K/M suffixes), float32")
    ap.add_argument("--runs", type=int, default=7, help="blocks per measurement (the median is reported)")
    ap.add_argument("--paths", default="shm,tcp,netns", help="which of shm,tcp,netns to run")
    ap.add_argument("--no-netns", action="store_true", help="skip the network-namespace path")
    ap.add_argument("--copy-threads", type=int, default=0,
                    help="FTC10D_WINDOW_COPY_THREADS for the ranks (0: the library's default)")
    ap.add_argument("--json", default=None, help="also write the raw samples here")
    ap.add_argument("--_worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker is not None:
        _worker_main(args._worker, args._store, json.loads(args._cfg))
        return 0

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    t0 = time.time()
    results: dict[str, dict[str, Any]] = {}
    notes = []
    for path in paths:
        cfg = {"sizes": sizes, "runs": args.runs, "transport": "tcp" if path in ("tcp", "netns") else "auto",
               "copy_threads": args.copy_threads}
        if path == "netns":
            why = "--no-netns" if args.no_netns else netns_available()
            if why:
                notes.append(f"netns path skipped: {why}")
                continue
            both = _run_netns(cfg)
        else:
            both = run(_forked, 2, cfg)
        if not both[1]["data_ok"]:
            raise RuntimeError(f"{path}: the window's data did not arrive intact")
        results[path] = both[0]
    bw, lat, verdicts = _report(results, sizes)
    from ftc10d.window._resources import copy_threads

    threads = args.copy_threads or copy_threads()
    print(f"window: 2 ranks, float32, median of {args.runs} blocks per figure, iteration = put+signal+ack "
          f"(window) or send+ack (gloo), {threads} copy thread(s) for puts >= 8 MiB; {machine()}; "
          f"{time.time() - t0:.0f} s")
    print(bw)
    print("bw ratios: median of gloo over median of window; (paired) = median over runs of the per-run ratio; "
          "memcpy = one private copy of the same size, the floor of a same-host put")
    print()
    print(lat)
    for line in verdicts + notes:
        print(line)
    dump_json(args.json, {"sizes": sizes, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An ftc10d group's ops in torch's profiler, as torch's Gloo group's are (issue 25,
``ftc10d.pg.profiling``): for every op, the dispatcher's ``c10d::<op>`` span and the backend's
async ``<backend>:<op>`` span with the inputs' shapes, once per op, checked against torch's
native Gloo group on the same torch (its ``gloo:<op>`` events, renamed)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tests import harness

T = timedelta(seconds=20)


def _ops(rank: int, world: int) -> None:
    t = torch.ones(4)
    outs = [torch.zeros(4) for _ in range(world)]
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.reduce(t, 0)
    dist.all_gather(outs, t)
    dist.gather(t, outs if rank == 0 else None, 0)
    dist.scatter(t, outs if rank == 0 else None, 0)
    dist.all_to_all([torch.zeros(2) for _ in range(world)], [torch.ones(2) for _ in range(world)])
    dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world))
    work = dist.all_reduce(torch.ones(3, 5), async_op=True)
    work.wait()
    dist.barrier()
    if rank == 0:
        for peer in range(1, world):
            dist.send(t, peer)
            dist.send(t, peer)
    else:
        dist.recv(t, 0)
        dist.recv(t)  # from any source


def _profiled(rank: int, world: int, port: int, backend: str) -> dict:
    harness.init_default_group(backend, rank, world, port, T)
    _ops(rank, world)  # warm: connections made outside the profile
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        _ops(rank, world)
    events: dict = {}
    for e in prof.function_events:
        if e.name.startswith(f"{backend}:") or e.name.startswith("c10d::"):
            name = e.name.replace(f"{backend}:", "<backend>:")
            events.setdefault(name, []).append((e.is_async, e.count, str(e.input_shapes)))
    dist.destroy_process_group()
    return {"events": {k: sorted(v) for k, v in events.items()}}


def test_ops_in_the_profiler_as_on_gloo() -> None:
    """Every ``gloo:<op>`` event of torch's Gloo group has its ``ftc10d:<op>`` twin on an
    ftc10d group: as many, async, same input shapes; every ``c10d::`` dispatcher op too."""
    gloo = harness.run(_profiled, 3, "gloo")
    ours = harness.run(_profiled, 3, "ftc10d")
    for rank in range(3):
        g, o = gloo[rank]["events"], ours[rank]["events"]
        backend_ops = {k: v for k, v in g.items() if k.startswith("<backend>:")}
        assert backend_ops, g  # Gloo recorded them: the comparison below compares something
        for name, evs in backend_ops.items():
            assert o.get(name) == evs, (rank, name, evs, o.get(name))
        assert all(is_async for k, v in o.items() if k.startswith("<backend>:") for is_async, _, _ in v)
        dispatcher = {k for k in g if k.startswith("c10d::")}
        assert dispatcher <= set(o), (rank, dispatcher - set(o))
        assert len(o["<backend>:all_reduce"]) == 2  # the sync one and the async one, each once

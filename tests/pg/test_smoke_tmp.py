import os, signal, time
from datetime import timedelta
import torch, torch.distributed as dist
import ftc10d
from tests import harness


def _handles(store, pg, rank, world, tag):
    store.set(f"test/{tag}/{rank}", pg.get_reconfigure_handle())
    keys = [f"test/{tag}/{r}" for r in range(world)]
    store.wait(keys)
    return [v.decode() for v in store.multi_get(keys)]


def _shrink(rank, world, port):
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=5))
    hs = _handles(store, pg, rank, world, "h")
    t = torch.ones(2); dist.all_reduce(t, group=pg)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    w = pg.allreduce([torch.ones(1000)])
    t0 = time.perf_counter()
    try:
        w.wait(); err = None
    except Exception as e:
        err = (type(e).__name__, str(e))
    t1 = time.perf_counter()
    survivors = [h for i, h in enumerate(hs) if i != 2]
    ftc10d.reconfigure(7, survivors, group=pg)
    t = torch.full((3,), float(pg.rank())); dist.all_reduce(t, group=pg)
    return err, t1 - t0, pg.rank(), pg.size(), t.tolist()


def test_shrink():
    job = harness.start(_shrink, 4)
    try:
        res = job.collect([0, 1, 3], timeout=60)
    finally:
        job.close()
    for r, v in res.items():
        print(r, v)

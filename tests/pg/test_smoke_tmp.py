from datetime import timedelta
import torch, torch.distributed as dist
import ftc10d
from tests import harness


def _basic(rank, world, port):
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=20))
    t = torch.full((4,), float(rank))
    dist.all_reduce(t, group=pg)
    out = torch.zeros(world * 2)
    dist.all_gather_single(out, torch.full((2,), float(rank)), group=pg)
    return t.tolist(), out.tolist(), dist.get_world_size(pg)


def test_basic():
    res = harness.run(_basic, 3)
    for r, (t, out, ws) in res.items():
        assert t == [3.0] * 4
        assert out == [0, 0, 1, 1, 2, 2]
        assert ws == 3

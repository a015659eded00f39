"""torch's own sub-group APIs on an ftc10d default group (issue 15, item 1).

The same calls a DeviceMesh / FSDP2 / torchtitan user makes, on 4 real processes over
Gloo: ``new_group``, ``new_subgroups``, ``init_device_mesh``, ``get_process_group_ranks``,
``get_backend``, ``destroy_process_group``, ``ProcessGroup.split_group``. A sub-group of an
ftc10d group is an ftc10d group; when the parent reconfigures, the sub-groups of its old
configuration raise ``ParentReconfiguredError`` and one ``init_device_mesh`` rebuilds a
mesh, with a replacement process in place of a dead one.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=20)


def _sub_groups(rank: int, world: int, port: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    pg = ftc10d.init_process_group(store=harness.client_store(port), rank=rank, world_size=world, timeout=T)
    out: dict = {"backend": dist.get_backend()}
    pair = dist.new_group([0, 1])
    evens = dist.new_group([0, 2])
    if rank in (0, 1):
        assert isinstance(pair, ftc10d.ProcessGroup), type(pair)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pair)
        out["pair_sum"] = t.item()
        out["pair_ranks"] = dist.get_process_group_ranks(pair)
        out["pair_backend"] = dist.get_backend(pair)
    else:
        assert pair == dist.GroupMember.NON_GROUP_MEMBER
    if rank in (0, 2):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        out["evens_sum"] = t.item()
    mine, all_subgroups = dist.new_subgroups(group_size=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    out["subgroup_sum"] = t.item()
    out["subgroups"] = len(all_subgroups)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        assert isinstance(g, ftc10d.ProcessGroup), (dim, type(g))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        out[f"mesh_{dim}_sum"] = t.item()
        out[f"mesh_{dim}_ranks"] = dist.get_process_group_ranks(g)

    split = pg.split_group([1, 3])
    if rank in (1, 3):
        assert isinstance(split, ftc10d.ProcessGroup), type(split)
        t = torch.tensor([1.0])
        split.allreduce([t]).wait()
        out["split_sum"] = t.item()
    else:
        assert split is None

    if rank in (0, 2):
        dist.destroy_process_group(evens)
        with pytest.raises(KeyError):
            dist.get_process_group_ranks(evens)  # gone from torch's tables (as for a Gloo group)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_new_group_subgroups_device_mesh_split_and_destroy_on_an_ftc10d_default_group() -> None:
    res = harness.run(_sub_groups, 4)
    for r in range(4):
        out = res[r]
        assert out["backend"] == "ftc10d"
        assert out["subgroup_sum"] == (0 + 1 if r < 2 else 2 + 3) and out["subgroups"] == 2
        # dp groups: {0, 2}, {1, 3}; tp groups: {0, 1}, {2, 3}
        assert out["mesh_dp_ranks"] == [r % 2, r % 2 + 2] and out["mesh_dp_sum"] == 2 * (r % 2) + 2
        assert out["mesh_tp_ranks"] == [r - r % 2, r - r % 2 + 1] and out["mesh_tp_sum"] == 2 * (r - r % 2) + 1
    for r in (0, 1):
        assert res[r]["pair_sum"] == 3.0 and res[r]["pair_ranks"] == [0, 1] and res[r]["pair_backend"] == "ftc10d"
    for r in (0, 2):
        assert res[r]["evens_sum"] == 2.0
    for r in (1, 3):
        assert res[r]["split_sum"] == 2.0


def _mesh_after_reconfigure(rank: int, world: int, port: int) -> dict:
    """Ranks 0-3 train on a 2x2 mesh; rank 3 is SIGKILLed; the survivors and a replacement
    (harness rank 4) reconfigure the default group and rebuild the mesh with one call."""
    from torch.distributed.device_mesh import init_device_mesh

    store = harness.client_store(port)
    pg = ftc10d.init_process_group(store=store, rank=min(rank, 3), world_size=4, timeout=T, enable_reconfigure=True)
    store.set(f"h/{rank}", pg.get_reconfigure_handle())
    out: dict = {}
    if rank < 4:
        first = [store.get(f"h/{r}").decode() for r in range(4)]
        ftc10d.reconfigure(1, first, group=pg)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh.get_group("dp")
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dp)
        out["dp_before"] = t.item()
        harness.store_barrier(store, "trained", rank, 4)
        if rank == 3:
            store.set("dead", "1")
            os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["dead"], timedelta(seconds=60))
    second = [store.get(f"h/{r}").decode() for r in (0, 1, 2, 4)]
    ftc10d.reconfigure(2, second, group=pg)  # rank 4 takes rank 3's place
    new_rank = pg.rank()
    if rank < 4:
        with pytest.raises(ftc10d.ParentReconfiguredError, match="reconfigured to uuid 2"):
            dist.all_reduce(torch.tensor([1.0]), group=dp)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # the one call that rebuilds it
    for dim in ("dp", "tp"):
        t = torch.tensor([float(new_rank)])
        dist.all_reduce(t, group=mesh.get_group(dim))
        out[f"{dim}_after"] = t.item()
    out["new_rank"] = new_rank
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_a_mesh_is_rebuilt_with_one_call_after_its_parent_drops_a_rank_and_admits_a_replacement() -> None:
    job = harness.start(_mesh_after_reconfigure, 5)
    try:
        res = job.collect(ranks=[0, 1, 2, 4], timeout=150)
    finally:
        job.close()
    for r in (0, 1, 2):
        assert res[r]["dp_before"] == 2 * (r % 2) + 2  # dp groups {0, 2} and {1, 3}
    assert sorted(res[r]["new_rank"] for r in (0, 1, 2, 4)) == [0, 1, 2, 3]
    for r in (0, 1, 2, 4):
        n = res[r]["new_rank"]
        assert res[r]["dp_after"] == 2 * (n % 2) + 2 and res[r]["tp_after"] == 2 * (n - n % 2) + 1, res[r]


def _hsdp_steps(rank: int, world: int, port: int, backend: str) -> dict:
    """Three FSDP2 steps of a small MLP, HSDP over a 2x2 mesh (replicate x shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = harness.client_store(port)
    if backend == "ftc10d":
        ftc10d.init_process_group(store=store, rank=rank, world_size=world, timeout=T)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=T)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kinds = {type(mesh.get_group(d)).__module__ for d in ("replicate", "shard")}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    # as lists: a tensor sent through the harness's queue needs its sender alive (shared memory)
    state = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return {"state": state, "groups": sorted(kinds)}


def test_fsdp2_hsdp_over_an_ftc10d_mesh_trains_bitwise_like_gloo() -> None:
    ours = harness.run(_hsdp_steps, 4, "ftc10d")
    gloo = harness.run(_hsdp_steps, 4, "gloo")
    assert ours[0]["groups"] == ["ftc10d.pg.process_group"] and "ftc10d" not in gloo[0]["groups"][0]
    for r in range(4):
        assert ours[r]["state"].keys() == gloo[r]["state"].keys()
        for k, v in ours[r]["state"].items():
            assert v == gloo[r]["state"][k], (r, k)  # float32 values as Python floats: exact
            assert v == ours[0]["state"][k], (r, k)  # every rank holds the same model


def _torch_init(rank: int, world: int, port: int) -> dict:
    store = harness.client_store(port)
    dist.init_process_group("ftc10d", store=store, rank=rank, world_size=world, timeout=T)
    pg = dist.group.WORLD
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gloo_sub = dist.new_group([0, 1], backend="gloo")  # a Gloo group beside it still works
    u = torch.tensor([1.0])
    dist.all_reduce(u, group=gloo_sub)
    out = {"ours": isinstance(pg, ftc10d.ProcessGroup), "backend": dist.get_backend(), "sum": t.item(),
           "gloo_sum": u.item(), "gloo_is_ours": isinstance(gloo_sub, ftc10d.ProcessGroup)}
    dist.destroy_process_group()
    return out


def test_torchs_init_process_group_with_backend_ftc10d_makes_an_ftc10d_default_group() -> None:
    res = harness.run(_torch_init, 2)
    for r in range(2):
        assert res[r] == {"ours": True, "backend": "ftc10d", "sum": 3.0, "gloo_sum": 2.0, "gloo_is_ours": False}

"""The seam FT-HSDP is built on (issue 16): FSDP2 over a 1-D mesh of one replica's ftc10d
shard group, the cross-replica all-reduce through FSDP2's ``set_all_reduce_hook`` on an
ftc10d replicate group (torchtitan's seam for torchft).

Two facts the design needs, checked against torch's own HSDP over a 2x2 Gloo mesh:

- the split gives the same model, bitwise: FSDP2 averages over the shard group in its
  reduce-scatter, the hook over the replicas, the order torch's HSDP uses;
- the shard group can be reconfigured in place (same Python object, a new configuration)
  under a module FSDP2 already sharded over it (``DeviceMesh.from_group``): training goes on.
  This is what lets a replica's surviving ranks keep their FSDP2 state when a dead rank's
  replacement takes its place, instead of rebuilding the module.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ftc10d
from tests import harness

T = timedelta(seconds=30)
R, S = 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model: Any, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: Any) -> dict[str, list]:
    # as lists: a tensor sent through the harness's queue needs its sender alive (shared memory)
    return {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}


def _seam(rank: int, world: int, port: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    store = harness.client_store(port)
    replica, shard_index = divmod(rank, S)
    ftc10d.init_process_group(store=dist.PrefixStore("world", store), rank=rank, world_size=world, timeout=T)
    shard = ftc10d.ProcessGroup(dist.PrefixStore(f"shard{replica}", store), 0, S, timeout=T, enable_reconfigure=True)
    replicate = ftc10d.ProcessGroup(dist.PrefixStore(f"replicate{shard_index}", store), replica, R, timeout=T)
    store.set(f"h/{replica}/{shard_index}", shard.get_reconfigure_handle())
    handles = [store.get(f"h/{replica}/{i}").decode() for i in range(S)]
    ftc10d.reconfigure(1, handles, group=shard)
    mesh = DeviceMesh.from_group(shard, "cpu")

    def all_reduce_hook(grad: torch.Tensor) -> None:
        replicate.allreduce([grad]).wait()
        grad.div_(replicate.size())

    model = _model()
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
        m.set_all_reduce_hook(all_reduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, rank, range(2))
    before = shard.generation
    ftc10d.reconfigure(2, handles, group=shard)  # in place, under FSDP2's feet
    _train(model, opt, rank, range(2, 3))
    return {"state": _full(model), "new configuration": shard.generation is not before and shard.uuid == 2}


def _torch_hsdp(rank: int, world: int, port: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=harness.client_store(port), rank=rank, world_size=world, timeout=T)
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, rank, range(3))
    return {"state": _full(model)}


def test_fsdp2_over_a_shard_group_with_the_replica_all_reduce_in_its_hook_matches_torchs_hsdp() -> None:
    ours = harness.run(_seam, R * S)
    torch_hsdp = harness.run(_torch_hsdp, R * S)
    for r in range(R * S):
        assert ours[r]["new configuration"], "the shard group did not move to its second configuration"
        assert ours[r]["state"] == torch_hsdp[r]["state"], f"rank {r}: differs from torch's HSDP"
        assert ours[r]["state"] == ours[0]["state"]

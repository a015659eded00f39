"""torchtitan's ``ParallelDims`` over ftc10d's FT-HSDP groups.

torchtitan builds its meshes itself: ``init_device_mesh`` on the default group, then
``_unflatten``, which makes plain sub-groups of the world that would go stale at the first
reconfigure. Under FT-HSDP torchtitan sees only what happens *inside* one replica: FSDP2
over the replica's ftc10d shard group (one group object for the life of the job, its rank
= the shard index, reconfigured in place), while the replicate axis is ftc10d's own
(``Manager.fsdp`` routes FSDP2's all-reduce hook through the replicate group). So every
mesh torchtitan asks for (``fsdp``, ``dp_shard``, ``loss``, the world mesh) is the 1-D mesh
of the shard group, except ``batch``, which only tells the data loader which part of the
data this rank reads: ``replicas x shard_size`` parts, part ``replica * shard_size + shard``.
"""

from __future__ import annotations

from typing import Any

from torchtitan.distributed.parallel_dims import ParallelDims

from ftc10d.types import InvalidOptionError


class _Absent:
    """A parallelism axis FT-HSDP does not use (degree 1: torchtitan treats it as disabled)."""

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0


class DataAxis:
    """Where this rank reads in the data: ``size()`` parts, this rank's is ``get_local_rank()``.
    Not a mesh: nothing communicates over it (torchtitan asks the ``batch`` mesh only that)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


class FTParallelDims(ParallelDims):
    """torchtitan's view of one FT-HSDP replica (module docstring)."""

    def __init__(self, parallelism: Any, shard_mesh: Any, *, replicas: int, replica: int, shard_index: int) -> None:
        unsupported = {name: getattr(parallelism, attr) for name, attr in (
            ("tensor", "tensor_parallel_degree"), ("context", "context_parallel_degree"),
            ("pipeline", "pipeline_parallel_degree"), ("expert", "expert_parallel_degree"),
            ("replicate", "data_parallel_replicate_degree")) if getattr(parallelism, attr, 1) not in (1, -1)}
        if unsupported:
            raise InvalidOptionError(
                f"ftc10d's torchtitan trainer runs FT-HSDP: FSDP2 inside each replica, ftc10d's replicas across "
                f"(--ftc10d.replicas); {', '.join(f'{k} parallel degree {v}' for k, v in unsupported.items())} is not "
                "supported yet: leave those degrees at 1")
        shard_size = shard_mesh.size()
        shard = parallelism.data_parallel_shard_degree
        if shard not in (-1, shard_size):
            raise InvalidOptionError(f"--parallelism.data-parallel-shard-degree {shard}: under FT-HSDP it is the "
                                     f"shard group's size, {shard_size} (WORLD_SIZE / --ftc10d.replicas); leave it -1")
        super().__init__(dp_replicate=1, dp_shard=shard_size, cp=1, tp=1, pp=1, ep=1, world_size=shard_size,
                         spmd_backend=parallelism.spmd_backend)
        self.shard_mesh = shard_mesh
        self.data = DataAxis(replicas * shard_size, replica * shard_size + shard_index)

    def build_mesh(self) -> Any:
        mesh = self.shard_mesh
        absent = _Absent()
        self._single_axis_meshes = {"fsdp": mesh, "dp_shard": mesh, "loss": mesh, "batch": self.data,  # type: ignore
                                    "dp_replicate": absent, "cp": absent, "tp": absent, "pp": absent, "ep": absent,
                                    "efsdp": absent, "dp": mesh}
        self._world_mesh = mesh
        return mesh

    @property
    def dp_enabled(self) -> bool:
        return self.data.size() > 1

    @property
    def dp_cp_enabled(self) -> bool:
        return self.shard_mesh.size() > 1

    def get_all_one_dimensional_meshes(self) -> dict[str, Any]:
        return {"fsdp": self.shard_mesh} if self.shard_mesh.size() > 1 else {}

"""Where each rank sits in an HSDP job: mesh axes, coordinates, and which replicas can train.

FT-HSDP (issue 16, in progress) shards parameters over the ``S`` ranks of a replica
(FSDP2, over the replica's *shard group*) and replicates them over ``R`` replicas (the
fault-tolerant axis: the cross-replica all-reduce runs in FSDP2's
``set_all_reduce_hook`` on an ftc10d group, ``tests/train/test_fsdp_seam.py``).

A rank's coordinates come from its **slot**, not from its rank in the current
configuration: ``ftc10d launch`` gives a slot's worker (and the replacement or warm spare
that takes the slot after it died) the same ``RANK``, so a replacement lands where the
dead rank was: ``replica, shard_index = divmod(slot, S)``. Ranks in a configuration move
(they follow membership order); slots do not.

After each configuration change every rank knows every live rank's slot (they travel in
the recovery plan's all-reduce), and :meth:`HSDPLayout.placement` derives, identically
on every rank:

- the **complete** replicas (all ``S`` shard indices live): they train;
- the ranks of an incomplete replica wait warm, keeping their shard, until the
  replacement arrives and the replica is complete again;
- per shard index, the ranks that hold that shard (the recovery plan picks a source
  among them: only a rank of the same shard index can give a replacement its shard).

Two live ranks claiming one slot (a fenced member that came back while a replacement
took its place) are resolved by rank order: the lower rank holds the slot, the other is
surplus and waits like a spare.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ftc10d.types import InvalidOptionError


class MeshAxis(str, enum.Enum):
    """The names of the HSDP mesh's axes (torch's ``mesh_dim_names``)."""

    REPLICATE = "replicate"  # across replicas: fault tolerant, averaged over the replicas that train
    SHARD = "shard"  # inside one replica: FSDP2's all-gather and reduce-scatter


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(f"{name}={value!r}: a whole number >= 1")
    return value


@dataclass(frozen=True)
class HSDPLayout:
    """``replicas`` x ``shard_size`` ranks at full strength, slot ``k`` at ``divmod(k, shard_size)``."""

    #: R: replicas at full strength (the replicate axis).
    replicas: int
    #: S: ranks per replica, over which FSDP2 shards (the shard axis).
    shard_size: int

    def __post_init__(self) -> None:
        _positive("replicas", self.replicas)
        _positive("shard_size", self.shard_size)

    @property
    def world_size(self) -> int:
        return self.replicas * self.shard_size

    @property
    def mesh_dim_names(self) -> tuple[str, str]:
        return (MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)

    def coords(self, slot: int) -> tuple[int, int]:
        """``(replica, shard_index)`` of ``slot``."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.world_size:
            raise InvalidOptionError(
                f"slot {slot!r} is outside this {self.replicas}x{self.shard_size} mesh "
                f"(slots 0..{self.world_size - 1}); "
                f"start {self.world_size} workers (ftc10d launch --nnodes x --nproc-per-node = replicas x shard), "
                "or give the Manager each worker's slot (its RANK under ftc10d launch)")
        return divmod(slot, self.shard_size)

    def placement(self, slots: Sequence[int]) -> "Placement":
        """Who holds what, from the slot of every rank of a configuration (``slots[rank]``)."""
        holder: dict[int, int] = {}
        for rank, slot in enumerate(slots):
            self.coords(slot)
            holder.setdefault(slot, rank)  # a slot claimed twice: the lower rank holds it
        complete = tuple(r for r in range(self.replicas)
                         if all(r * self.shard_size + s in holder for s in range(self.shard_size)))
        surplus = tuple(rank for rank, slot in enumerate(slots) if holder[slot] != rank)
        return Placement(self, tuple(slots), holder, complete, surplus)


@dataclass(frozen=True)
class Placement:
    """One configuration's ranks on the mesh (see :meth:`HSDPLayout.placement`)."""

    layout: HSDPLayout
    #: ``slots[rank]``: every rank's slot in this configuration.
    slots: tuple[int, ...]
    #: slot -> the rank holding it.
    holder: dict[int, int] = field(repr=False)
    #: The replicas with every shard index live, ascending: the ones that train.
    complete: tuple[int, ...]
    #: Ranks whose slot another (lower) rank holds.
    surplus: tuple[int, ...]

    def coords(self, rank: int) -> Optional[tuple[int, int]]:
        """``(replica, shard_index)`` of ``rank``; None for a surplus rank."""
        if not 0 <= rank < len(self.slots):
            raise InvalidOptionError(f"rank {rank} is not in this configuration of {len(self.slots)} ranks")
        if rank in self.surplus:
            return None
        return self.layout.coords(self.slots[rank])

    def replica_ranks(self, replica: int) -> list[Optional[int]]:
        """The ranks of ``replica`` by shard index (None where that shard index is not live)."""
        s = self.layout.shard_size
        if not 0 <= replica < self.layout.replicas:
            raise InvalidOptionError(f"replica {replica} is not in 0..{self.layout.replicas - 1}")
        return [self.holder.get(replica * s + i) for i in range(s)]

    def shard_ranks(self, shard_index: int, *, complete_only: bool = False) -> list[int]:
        """The ranks holding ``shard_index``, by replica; only the complete replicas' with
        ``complete_only`` (the replicate group that trains)."""
        if not 0 <= shard_index < self.layout.shard_size:
            raise InvalidOptionError(f"shard index {shard_index} is not in 0..{self.layout.shard_size - 1}")
        reps = self.complete if complete_only else range(self.layout.replicas)
        ranks = [self.holder.get(r * self.layout.shard_size + shard_index) for r in reps]
        return [r for r in ranks if r is not None]

    @property
    def participants(self) -> list[int]:
        """The ranks that train: every rank of a complete replica, by (replica, shard index)."""
        return [rank for rep in self.complete for rank in self.replica_ranks(rep) if rank is not None]

    def trains(self, rank: int) -> bool:
        c = self.coords(rank)
        return c is not None and c[0] in self.complete

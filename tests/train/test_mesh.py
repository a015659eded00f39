"""HSDP placement: coordinates from slots, complete replicas, shard holders (issue 16)."""

from __future__ import annotations

import pytest

from ftc10d.train.mesh import HSDPLayout, MeshAxis
from ftc10d.types import InvalidOptionError


def test_full_strength_places_every_slot() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    p = lay.placement([0, 1, 2, 3])
    assert p.complete == (0, 1) and p.surplus == ()
    assert p.participants == [0, 1, 2, 3]
    assert [p.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert p.shard_ranks(1) == [1, 3] and p.replica_ranks(1) == [2, 3]
    assert lay.mesh_dim_names == (MeshAxis.REPLICATE.value, MeshAxis.SHARD.value) == ("replicate", "shard")


def test_a_dead_rank_takes_its_replica_out_and_its_replacement_lands_in_its_place() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    # slot 1 died: ranks follow membership order, slots do not
    p = lay.placement([0, 2, 3])
    assert p.complete == (1,) and p.participants == [1, 2]
    assert not p.trains(0) and p.coords(0) == (0, 0)  # waits warm, keeps its shard
    assert p.shard_ranks(0) == [0, 1] and p.shard_ranks(0, complete_only=True) == [1]
    assert p.replica_ranks(0) == [0, None]
    # the replacement gets the slot's RANK, and membership order puts it last
    q = lay.placement([0, 2, 3, 1])
    assert q.complete == (0, 1) and q.coords(3) == (0, 1) and q.participants == [0, 3, 1, 2]


def test_a_whole_replica_lost_leaves_the_other_training_and_r1_has_no_spare_holder() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    p = lay.placement([2, 3])  # replica 0's node is gone, launcher and all
    assert p.complete == (1,) and p.participants == [0, 1]
    assert p.shard_ranks(0) == [0] and p.shard_ranks(1) == [1]
    r1 = HSDPLayout(replicas=1, shard_size=3).placement([0, 2])
    assert r1.complete == () and r1.shard_ranks(1) == []  # shard 1 has no holder at all


def test_a_slot_claimed_twice_is_held_by_the_lower_rank() -> None:
    p = HSDPLayout(replicas=2, shard_size=2).placement([0, 1, 2, 3, 1])
    assert p.surplus == (4,) and p.coords(4) is None and not p.trains(4)
    assert p.participants == [0, 1, 2, 3]


@pytest.mark.parametrize("kw", [{"replicas": 0, "shard_size": 2}, {"replicas": 2, "shard_size": -1},
                                {"replicas": True, "shard_size": 2}, {"replicas": 2, "shard_size": 1.5}])
def test_bad_sizes_are_refused(kw: dict) -> None:
    with pytest.raises(InvalidOptionError, match="whole number >= 1"):
        HSDPLayout(**kw)


def test_a_slot_outside_the_mesh_says_how_many_workers_to_start() -> None:
    with pytest.raises(InvalidOptionError, match="outside this 2x2 mesh .* start 4 workers"):
        HSDPLayout(replicas=2, shard_size=2).placement([0, 1, 4])


def test_indices_outside_the_mesh_are_refused() -> None:
    p = HSDPLayout(replicas=2, shard_size=2).placement([0, 1, 2, 3])
    with pytest.raises(InvalidOptionError, match="shard index 2 is not in 0..1"):
        p.shard_ranks(2)
    with pytest.raises(InvalidOptionError, match="replica 2 is not in 0..1"):
        p.replica_ranks(2)
    with pytest.raises(InvalidOptionError, match="rank 4 is not in this configuration"):
        p.coords(4)

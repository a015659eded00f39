"""FT-HSDP recovery (issue 16): per shard index, a replacement gets its shard from a live
rank of the same shard index; a shard with no holder left is a StateLostError."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

import ftc10d
from ftc10d.train.mesh import HSDPLayout
from ftc10d.train.recovery import exchange_info, shard_plans, transfer
from ftc10d.types import StateLostError
from tests import harness

T = timedelta(seconds=30)


def _rows(*rows: tuple[int, bool, int, int]) -> list[tuple[int, bool, int, int]]:
    return list(rows)


def test_a_replacement_receives_from_the_live_rank_of_its_shard_index() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    # slot 1 died and was replaced (membership order: the replacement is rank 3)
    rows = _rows((40, True, 3, 0), (40, True, 3, 2), (40, True, 3, 3), (0, False, 0, 1))
    plans = shard_plans(lay.placement([r[3] for r in rows]), rows)
    assert (plans[0].source, plans[0].recipients) == (0, [])
    assert (plans[1].source, plans[1].recipients) == (2, [3])  # slot 3 holds shard index 1
    assert plans[1].p2p_only and (plans[1].epoch, plans[1].step) == (3, 40)


def test_a_replica_that_waited_for_its_replacement_is_brought_up_to_date_too() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    # replica 0 waited at step 40 (its slot 1 died) while replica 1 trained on to 55
    rows = _rows((40, True, 3, 0), (55, True, 4, 2), (55, True, 4, 3), (0, False, 0, 1))
    plans = shard_plans(lay.placement([r[3] for r in rows]), rows)
    assert (plans[0].source, plans[0].recipients) == (1, [0])
    assert (plans[1].source, plans[1].recipients) == (2, [3])


def test_a_fresh_job_sends_each_shard_from_its_lowest_rank() -> None:
    rows = _rows(*[(0, False, 0, s) for s in (3, 2, 1, 0)])
    plans = shard_plans(HSDPLayout(replicas=2, shard_size=2).placement([r[3] for r in rows]), rows)
    assert (plans[0].source, plans[0].recipients) == (1, [3])
    assert (plans[1].source, plans[1].recipients) == (0, [2])


def test_every_holder_of_a_shard_gone_is_state_lost_also_with_one_replica() -> None:
    lay = HSDPLayout(replicas=2, shard_size=2)
    rows = _rows((40, True, 3, 0), (40, True, 3, 2), (0, False, 0, 1), (0, False, 0, 3))  # slots 1 and 3 died
    with pytest.raises(StateLostError,
                       match=r"shard 1 of the 2x2 mesh is lost: .* \(3, 40\), and its live ranks \[2, 3\]"):
        shard_plans(lay.placement([r[3] for r in rows]), rows)
    r1 = HSDPLayout(replicas=1, shard_size=2)
    with pytest.raises(StateLostError, match="shard 1 of the 1x2 mesh is lost"):
        shard_plans(r1.placement([0]), _rows((9, True, 1, 0)))


def _move_shards(rank: int, world: int, port: int, slots: list[int], synced: list[int]) -> dict[str, Any]:
    """Every rank's state is its slot's shard; the ranks in ``synced`` hold step 7 of the job,
    the others nothing yet. After the plans ran, every rank must hold its shard index's."""
    pg = ftc10d.ProcessGroup(harness.client_store(port), rank, world, timeout=T)
    lay = HSDPLayout(replicas=world // 2, shard_size=2)
    slot = slots[rank]
    index = slot % 2
    mine = rank in synced
    state = {"w": torch.full((1000,), float(index + 1) if mine else -1.0), "step": 7 if mine else 0}
    rows = exchange_info(pg, 7 if mine else 0, mine, 3 if mine else 0, slot)
    placement = lay.placement([r[3] for r in rows])
    plans = shard_plans(placement, rows)
    got, _, _ = transfer(pg, plans[index], lambda: state)
    if got is not None:
        state = got
    pg.barrier().wait()
    return {"w": sorted(set(state["w"].tolist())), "step": state["step"], "index": index}


@pytest.mark.parametrize("slots,synced", [
    ([0, 1, 2, 3], [2, 3]),  # replica 0 replaced whole (its node lost): one recipient per index
    ([4, 5, 0, 1, 2, 3], [0, 1]),  # two replicas new, one survivor: two recipients per index, p2p
])
def test_shards_move_from_their_index_holders_at_once_on_one_group(slots: list[int], synced: list[int]) -> None:
    out = harness.run(_move_shards, len(slots), slots, synced)
    for rank, res in out.items():
        assert res == {"w": [float(res["index"] + 1)], "step": 7, "index": slots[rank] % 2}, (rank, res)

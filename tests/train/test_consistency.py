"""The replica comparison's arithmetic (:mod:`ftc10d.train.consistency`); the comparison
under real faults is in test_split_vote.py."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ftc10d.train.consistency import FP_WORDS, fingerprint48, groups_of, join_words, split_words


@given(st.integers(min_value=0, max_value=(1 << 48) - 1))
def test_a_fingerprint_survives_a_float32_vote_exactly(value: int) -> None:
    """Each word sits alone in its slot (the others' slots are 0): a float32 sum is exact."""
    words = split_words(value)
    assert len(words) == FP_WORDS and all(0 <= w < 1 << 16 for w in words)
    slots = torch.zeros(3 * FP_WORDS, dtype=torch.float32)
    slots[FP_WORDS:2 * FP_WORDS] = torch.tensor(words, dtype=torch.float32)
    summed = slots + torch.zeros_like(slots)
    assert join_words([int(w) for w in summed[FP_WORDS:2 * FP_WORDS].tolist()]) == value


def test_fingerprint48_keeps_the_low_48_bits() -> None:
    assert fingerprint48("ffffffffffffffff") == (1 << 48) - 1
    assert fingerprint48("0000000000000001") == 1


def test_the_odd_ranks_are_outside_the_largest_group() -> None:
    assert groups_of([5, 5, 5]) == ({"000000000005": [0, 1, 2]}, [])
    groups, odd = groups_of([7, 5, 5, 9])
    assert odd == [0, 3] and groups["000000000005"] == [1, 2]
    assert groups_of([1, 2])[1] == [1]  # a tie: the group of the lowest rank is kept

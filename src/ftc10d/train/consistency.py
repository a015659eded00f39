"""Comparing the replicas: fingerprints carried by the vote, identities after a reconfigure.

Why a check at all when the commit protocol keeps the replicas equal by construction
(:mod:`ftc10d.train.manager`): the construction assumes that every rank applies the same
update to the same bytes. A bug (ours or the caller's: a per-rank value in a registered
state), a bit flip or a non-deterministic optimizer breaks that silently, and DDP then
averages the gradients of different models for the rest of the run. A cheap comparison
turns that into a typed error at the next check.

Two places, both piggybacking on communication that happens anyway or rarely:

- *in the vote*, every ``check_every`` steps: each rank's 48-bit state fingerprint, as
  three 16-bit words (exact in a float32 gradient bucket) in a slot of its own, so that
  every rank sees every rank's value after the one all-reduce and names the odd ones;
- *after each configuration change*: one all-reduce of ``(fingerprint, step, commit
  epoch)`` per rank, once the state transfer is done.
"""

from __future__ import annotations

from typing import Any

import torch

from ftc10d.pg.channels import control

#: A fingerprint travels in the vote as this many 16-bit words.
FP_WORDS = 3
_MASK = (1 << (16 * FP_WORDS)) - 1


def fingerprint48(hex_fingerprint: str) -> int:
    """The 48 low bits of a state fingerprint (``ftc10d.train.state.fingerprint``)."""
    return int(hex_fingerprint, 16) & _MASK


def split_words(value: int) -> list[int]:
    return [(value >> (16 * i)) & 0xFFFF for i in range(FP_WORDS)]


def join_words(words: list[int]) -> int:
    return sum((int(w) & 0xFFFF) << (16 * i) for i, w in enumerate(words))


def groups_of(values: list[int]) -> tuple[dict[str, list[int]], list[int]]:
    """Ranks by value (hex) and the ranks outside the largest group (with a tie, outside the
    group of the lowest rank); no odd ranks when all values are equal."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(f"{v:012x}", []).append(r)
    largest = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    return groups, sorted(r for rs in groups.values() if rs is not largest for r in rs)


def groups_by_class(values: list[int], classes: list[int]) -> tuple[dict[str, list[int]], list[int]]:
    """:func:`groups_of` within each class (FT-HSDP: the ranks of one shard index hold equal
    states; ranks of different indices never do): keys ``"<class>:<hex>"``, odd ranks of
    every class together."""
    groups: dict[str, list[int]] = {}
    odd: list[int] = []
    for c in sorted(set(classes)):
        ranks = [r for r, k in enumerate(classes) if k == c]
        sub, sub_odd = groups_of([values[r] for r in ranks])
        groups.update({f"{c}:{h}": [ranks[i] for i in rs] for h, rs in sub.items()})
        odd += [ranks[i] for i in sub_odd]
    return groups, sorted(odd)


def exchange_identities(pg: Any, fingerprint: int, step: int, epoch: int) -> list[int]:
    """All-reduce every rank's ``(fingerprint, step, commit epoch)``; returns one value per rank
    that is equal for two ranks iff the three are (the fingerprint itself when only it varies,
    so that the error shows fingerprints)."""
    rows = torch.zeros(pg.size(), 3, dtype=torch.int64)
    rows[pg.rank()] = torch.tensor([fingerprint, step, epoch])
    with control():  # a two-channel group: on its CPU channel (ftc10d.pg.channels)
        pg.allreduce([rows]).wait()
    ids = [tuple(int(v) for v in row) for row in rows.tolist()]
    if len({i[1:] for i in ids}) == 1:
        return [i[0] for i in ids]
    # Mix step and epoch in (odd multipliers: distinct identities stay distinct but for a collision).
    return [(fp ^ (st * 0x9E3779B97F4A7C15) ^ (ep * 0xC2B2AE3D27D4EB4F)) & _MASK for fp, st, ep in ids]

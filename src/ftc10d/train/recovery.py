"""Live state recovery: after a configuration change, who is behind gets the state
of a healthy peer, over the group itself.

Why over the group: the new configuration's Gloo pairs are already connected
when this runs (reconfigure just built them), so there is no second transport
to set up, secure or tune, and the bytes move at Gloo's rate. One joiner gets a
point-to-point send from one source; several get one broadcast.

The plan is computed identically on every rank from one all-reduce of
``(committed step, synced)`` per rank: the source is the lowest rank holding
the highest committed step among ranks that hold synchronized state, and every
rank that is not synchronized or is behind receives. A rank ahead of the others
is possible: if a member died during the commit vote, some survivors may have
seen the unanimous vote and applied the step while others saw the failure;
bringing everyone to the highest step makes that step applied by all
(invariant 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ftc10d.train.state import Packed, pack, unpack

logger = logging.getLogger("ftc10d")

#: Tag of the point-to-point transfer messages (distinct from user p2p on the group).
STATE_TAG = 0x57A7E


@dataclass
class Plan:
    """Who sends the state to whom after a configuration change."""

    source: int
    recipients: list[int]
    step: int
    steps: list[int] = field(default_factory=list)
    synced: list[bool] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.recipients)


def make_plan(pg: Any, step: int, synced: bool) -> Plan:
    """One all-reduce of every rank's (step, synced); the same plan on every rank."""
    info = torch.zeros(pg.size(), 2, dtype=torch.int64)
    info[pg.rank(), 0] = step
    info[pg.rank(), 1] = int(synced)
    pg.allreduce([info]).wait()
    steps = [int(s) for s in info[:, 0].tolist()]
    flags = [bool(f) for f in info[:, 1].tolist()]
    if not any(flags):
        # A fresh job: rank 0's state is the truth, as for DDP's construction-time broadcast.
        return Plan(0, list(range(1, len(steps))), steps[0], steps, flags)
    target = max(s for s, f in zip(steps, flags) if f)
    source = min(r for r, (s, f) in enumerate(zip(steps, flags)) if f and s == target)
    recipients = [r for r, (s, f) in enumerate(zip(steps, flags)) if r != source and (not f or s != target)]
    return Plan(source, recipients, target, steps, flags)


def _bcast(pg: Any, t: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()


def transfer(pg: Any, plan: Plan, get_state: Callable[[], Any]) -> tuple[Optional[Any], int, float]:
    """Run ``plan``: returns ``(state or None, bytes moved, seconds)`` on this rank.

    The source packs ``get_state()`` (one copy into a flat buffer) and sends a
    header (skeleton length, buffer length), the JSON skeleton and the buffer.
    """
    me = pg.rank()
    t0 = time.perf_counter()
    if not plan.needed or (me != plan.source and me not in plan.recipients and len(plan.recipients) == 1):
        return None, 0, 0.0
    packed: Optional[Packed] = None
    header = torch.zeros(2, dtype=torch.int64)
    if me == plan.source:
        packed = pack(get_state())
        skel = torch.frombuffer(bytearray(packed.skeleton.encode()), dtype=torch.uint8)
        header[0], header[1] = skel.numel(), packed.buffer.numel()
        parts = [header, skel, packed.buffer]
        if len(plan.recipients) == 1:
            dst = plan.recipients[0]
            for p in parts:
                pg.send([p], dst, STATE_TAG).wait()
        else:
            for p in parts:
                _bcast(pg, p, plan.source)
        nbytes = packed.nbytes
        return None, nbytes, time.perf_counter() - t0
    p2p = len(plan.recipients) == 1

    def get(t: torch.Tensor) -> None:
        if p2p:
            pg.recv([t], plan.source, STATE_TAG).wait()
        else:
            _bcast(pg, t, plan.source)

    get(header)
    skel = torch.empty(int(header[0]), dtype=torch.uint8)
    buffer = torch.empty(int(header[1]), dtype=torch.uint8)
    get(skel)
    get(buffer)
    if me not in plan.recipients:
        return None, 0, time.perf_counter() - t0
    state = unpack(bytes(skel.numpy()).decode(), buffer)
    return state, int(skel.numel() + buffer.numel()), time.perf_counter() - t0

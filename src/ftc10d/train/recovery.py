"""Live state recovery: after a configuration change, who is behind gets the state
of a healthy peer, over the group itself.

Why over the group: the new configuration's Gloo pairs are already connected
when this runs (reconfigure just built them), so there is no second transport
to set up, secure or tune, and the bytes move at Gloo's rate. One joiner gets a
point-to-point send from one source; several get one broadcast.

The plan is computed identically on every rank from one all-reduce of
``(committed step, synced, commit epoch)`` per rank. A synchronized rank's state
is named by its *identity* ``(commit epoch, step)``: ``step`` counts the steps
applied, ``commit epoch`` is the membership epoch of the configuration in which
the last of them was committed (inherited from the source when the state was
received). The target is the greatest identity among synchronized ranks
(ordered by epoch, then step), the source the lowest rank holding it, and every
rank that is not synchronized or holds another identity receives.

Why the epoch and not the counter alone (``Manager``'s docstring has the whole
argument): a step counter names a state only within one history. A rank that
applied step ``s`` alone (the others saw the vote fail) and was then left out of
the next configuration is at ``s + 1``; the others redo step ``s`` without it and
are at ``s + 1`` too, with another state. Equal counters, different states: a
plan on counters moves nothing and the replicas stay diverged for the rest of the
run. The commit epochs differ, and the later configuration's history wins.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ftc10d.pg.channels import control
from ftc10d.pg.work import MultiWork
from ftc10d.train.progress import JobProgress
from ftc10d.train.state import (
    DIRECT_BYTES,
    StateFormatError,
    as_bytes,
    device_targets,
    in_place_targets,
    layout,
    segments,
    skeleton_sizes,
    unpack,
)
from ftc10d.types import StateLostError

if TYPE_CHECKING:
    from ftc10d.train.mesh import Placement

logger = logging.getLogger("ftc10d")

#: Tag of the point-to-point transfer messages (distinct from user p2p on the group).
STATE_TAG = 0x57A7E
#: A skeleton is JSON text describing the tensors, not the tensors: far below this. A header
#: announcing more is garbage, refused before anything is allocated.
MAX_SKELETON_BYTES = 64 << 20


@dataclass
class Plan:
    """Who sends the state to whom after a configuration change."""

    source: int
    recipients: list[int]
    #: The target identity: the source's step and commit epoch.
    step: int
    steps: list[int] = field(default_factory=list)
    synced: list[bool] = field(default_factory=list)
    epoch: int = 0
    epochs: list[int] = field(default_factory=list)
    #: Send to each recipient point to point, even to several (plans of disjoint rank sets
    #: run at once on one group: a broadcast would need every rank of it).
    p2p_only: bool = False
    #: What the membership knows of the job's newest state, as the ranks agreed on it.
    job: JobProgress = field(default_factory=JobProgress)

    @property
    def needed(self) -> bool:
        return bool(self.recipients)

    @property
    def target(self) -> Optional[tuple[int, int]]:
        """The identity ``(commit epoch, step)`` the plan brings every rank to; None when no
        rank holds a state (a fresh job)."""
        return (self.epoch, self.step) if any(self.synced) else None

    @property
    def held(self) -> list[Optional[tuple[int, int]]]:
        """Each rank's identity before the plan (None: no state)."""
        return [(e, s) if f else None for e, s, f in zip(self.epochs, self.steps, self.synced)]

    @property
    def diverged(self) -> list[int]:
        """Synchronized ranks whose state was applied with as many steps as the target's
        but in another configuration: a history the job does not continue (they receive)."""
        return [r for r in self.recipients
                if self.synced[r] and self.steps[r] == self.step and self.epochs[r] != self.epoch]


Row = tuple[int, bool, int, int, bool]


def exchange_info(pg: Any, step: int, synced: bool, epoch: int = 0, slot: int = -1,
                  ready: bool = True) -> list[Row]:
    """One all-reduce: every rank's ``(step, synced, commit epoch, slot, ready)`` (slot: its
    place on an HSDP mesh, :mod:`ftc10d.train.mesh`, -1 without one; ready: it has
    registered its state, so its fingerprint means something)."""
    return exchange(pg, step, synced, epoch, slot, ready)[0]


def exchange(pg: Any, step: int, synced: bool, epoch: int = 0, slot: int = -1, ready: bool = True,
             job: JobProgress = JobProgress()) -> tuple[list[Row], JobProgress]:
    """:func:`exchange_info`, and the job's progress as the ranks read it from the membership
    (``job``, :mod:`ftc10d.train.progress`), agreed: the greatest of what any rank read, so
    that every rank decides alike whether the configuration may continue the job."""
    def pair(ident: Any) -> list[int]:
        return [-1, -1] if ident is None else list(ident)

    info = torch.zeros(pg.size(), 9, dtype=torch.int64)
    info[pg.rank()] = torch.tensor([step, int(synced), epoch, slot, int(ready), *pair(job.reached), *pair(job.closed)],
                                   dtype=torch.int64)
    with control():  # a two-channel group: on its CPU channel (ftc10d.pg.channels)
        pg.allreduce([info]).wait()
    rows = info.tolist()
    reached = max(((r[5], r[6]) for r in rows if r[5] >= 0), default=None)
    closed = max(((r[7], r[8]) for r in rows if r[7] >= 0), default=None)
    return [(int(a), bool(b), int(c), int(d), bool(e)) for a, b, c, d, e, *_ in rows], JobProgress(reached, closed)


def plan_among(ranks: Sequence[int], steps: Sequence[int], flags: Sequence[bool], epochs: Sequence[int],
               *, p2p_only: bool = False) -> Plan:
    """The plan among ``ranks`` only (group numbering; ``steps``/``flags``/``epochs`` are
    indexed by rank over the whole group): the greatest identity among their synchronized
    ranks is the target, the lowest of them holding it the source, and every other one
    of ``ranks`` that is not synchronized or holds another identity receives. With none
    synchronized (a fresh job) the lowest of ``ranks`` is the source."""
    ranks = sorted(ranks)
    steps, flags, epochs = list(steps), list(flags), list(epochs)
    if not any(flags[r] for r in ranks):
        src = ranks[0]
        return Plan(src, ranks[1:], steps[src], steps, flags, epochs[src], epochs, p2p_only)
    ids = {r: (epochs[r], steps[r]) for r in ranks}
    target = max(ids[r] for r in ranks if flags[r])
    source = min(r for r in ranks if flags[r] and ids[r] == target)
    recipients = [r for r in ranks if r != source and (not flags[r] or ids[r] != target)]
    return Plan(source, recipients, target[1], steps, flags, target[0], epochs, p2p_only)


def make_plan(pg: Any, step: int, synced: bool, epoch: int = 0, job: JobProgress = JobProgress()) -> Plan:
    """One all-reduce of every rank's (step, synced, commit epoch) and view of the job's
    progress; the same plan on every rank."""
    rows, agreed = exchange(pg, step, synced, epoch, job=job)
    plan = plan_among(range(len(rows)), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    plan.job = agreed
    return plan


def transfer(pg: Any, plan: Plan, get_state: Callable[[], Any],
             local_state: Optional[Callable[[], Any]] = None) -> tuple[Optional[Any], int, float]:
    """Run ``plan``: returns ``(state or None, bytes moved, seconds)`` on this rank.

    The source sends a header (skeleton length, buffer length), the JSON
    skeleton, then the buffer as messages (:func:`ftc10d.train.state.segments`):
    a big tensor goes straight from its own memory, small neighbours are copied
    into one message. The receivers receive each message into its place in one
    flat buffer, whose layout both sides derive from the skeleton; the state's
    tensors are then views of that buffer. With ``local_state`` (a recipient whose
    own state may be overwritten while it arrives: a joiner), a tensor sent as a
    message of its own goes straight into the recipient's tensor of the same path,
    dtype and shape (:func:`ftc10d.train.state.in_place_targets`). All messages are issued before any
    is waited for, so they stream back to back.
    """
    me = pg.rank()
    t0 = time.perf_counter()
    p2p = plan.p2p_only or len(plan.recipients) == 1
    if not plan.needed or (p2p and me != plan.source and me not in plan.recipients):
        return None, 0, 0.0

    def move(t: torch.Tensor, i: int) -> Any:
        if p2p:
            if me == plan.source:
                sends = [pg.send([t], dst, STATE_TAG + i) for dst in plan.recipients]
                return sends[0] if len(sends) == 1 else MultiWork(sends, None)
            return pg.recv([t], plan.source, STATE_TAG + i)
        opts = dist.BroadcastOptions()
        opts.rootRank = plan.source
        return pg.broadcast([t], opts)

    header = torch.zeros(2, dtype=torch.int64)
    if me == plan.source:
        lay = layout(get_state())
        skel = torch.frombuffer(bytearray(lay.skeleton.encode()), dtype=torch.uint8)
        header[0], header[1] = skel.numel(), lay.total
        works = [move(header, 0), move(skel, 1)]
        sizes = [t.numel() * t.element_size() for t in lay.tensors]
        for k, (start, end, idx) in enumerate(segments(sizes, lay.offsets)):
            alone = lay.tensors[idx[0]] if len(idx) == 1 else None
            if alone is not None and (alone.device.type != "cpu" or (sizes[idx[0]] >= DIRECT_BYTES
                                                                      and alone.is_contiguous())):
                msg = as_bytes(alone)  # from its own memory (a device tensor: from the device, see device_targets)
            else:
                msg = torch.zeros(end - start, dtype=torch.uint8)
                for i in idx:
                    o = lay.offsets[i] - start
                    msg[o:o + sizes[i]].copy_(as_bytes(lay.tensors[i]))
            works.append(move(msg, 2 + k))
        for w in works:
            w.wait()
        copies = len(plan.recipients) if p2p else 1  # sent once to each, or one broadcast
        return None, (int(skel.numel()) + lay.total) * copies, time.perf_counter() - t0
    move(header, 0).wait()
    if not 0 < int(header[0]) <= MAX_SKELETON_BYTES or int(header[1]) < 0:
        raise StateFormatError(f"state header announces a skeleton of {int(header[0])} bytes and a buffer of "
                               f"{int(header[1])}; is the source's ftc10d the same?")
    skel = torch.empty(int(header[0]), dtype=torch.uint8)
    move(skel, 1).wait()
    try:
        skeleton = bytes(skel.numpy()).decode()
    except UnicodeDecodeError as exc:
        raise StateFormatError(f"state skeleton is not UTF-8 text: {exc}") from None
    sizes, offsets, total = skeleton_sizes(skeleton)
    if total != int(header[1]) or any(o < 0 or o + n > total for o, n in zip(offsets, sizes)):
        raise StateFormatError("the state skeleton does not fit the announced buffer; is the source's ftc10d the same?")
    buffer = torch.empty(total, dtype=torch.uint8)  # untouched where tensors are received in place
    fits = in_place_targets(skeleton, local_state()) if local_state is not None and me in plan.recipients else {}
    alone = [idx[0] for _, _, idx in segments(sizes, offsets) if len(idx) == 1]
    # a tensor the source holds on a device is received on that device type (the same channel)
    on_device = device_targets(skeleton, alone)
    for i, target in on_device.items():
        fit = fits.get(i)
        fits[i] = fit if fit is not None and fit.device.type == target.device.type else target
    for i in [i for i, t in fits.items() if i not in on_device and t.device.type != "cpu"]:
        del fits[i]  # the source sends it from host memory: received there too
    into: dict[int, torch.Tensor] = {}  # the tensors that do receive in place: alone in their message
    works = []
    for k, (start, end, idx) in enumerate(segments(sizes, offsets)):
        if len(idx) == 1 and idx[0] in fits:
            into[idx[0]] = fits[idx[0]]
            works.append(move(as_bytes(fits[idx[0]]), 2 + k))
        else:
            works.append(move(buffer[start:end], 2 + k))
    for w in works:
        w.wait()
    if me not in plan.recipients:
        return None, 0, time.perf_counter() - t0
    return unpack(skeleton, buffer, into), int(skel.numel()) + total, time.perf_counter() - t0


def shard_plans(placement: "Placement", rows: Sequence[tuple[Any, ...]]) -> dict[int, Plan]:
    """FT-HSDP recovery (issue 16): per shard index, who sends that shard's state to whom.

    ``rows`` are :func:`exchange_info`'s, ``placement`` the configuration's
    (:meth:`ftc10d.train.mesh.HSDPLayout.placement`). Only a rank of the same shard index
    can give a replacement its shard, so each index gets its own plan among its live
    holders (complete replicas or not: a replica waiting for its replacement is brought
    up to date too), sent point to point; the plans of different indices run at once.

    Every shard index must reach the same state: the job's, the greatest identity of any
    synchronized rank. An index none of whose live holders holds it (every replica that
    held the shard is gone: with ``R = 1``, any death) raises :class:`StateLostError`
    naming it: the job's state cannot be put together again; restore from a checkpoint.
    In a fresh job (nobody synchronized) each index's lowest rank is its source.
    """
    steps = [r[0] for r in rows]
    flags = [r[1] and placement.coords(i) is not None for i, r in enumerate(rows)]
    epochs = [r[2] for r in rows]
    held = [(epochs[i], steps[i]) for i in range(len(rows)) if flags[i]]
    target = max(held) if held else None
    plans: dict[int, Plan] = {}
    lay = placement.layout
    for index in range(lay.shard_size):
        ranks = placement.shard_ranks(index)
        plan = plan_among(ranks, steps, flags, epochs, p2p_only=True) if ranks else None
        if target is not None and (plan is None or not flags[plan.source] or (plan.epoch, plan.step) != target):
            have = "no live rank holds it" if plan is None else f"its live ranks {ranks}, at (epoch, step) " + \
                ", ".join(str((epochs[r], steps[r])) if flags[r] else "none" for r in ranks) + ", do not hold it"
            raise StateLostError(
                f"shard {index} of the {lay.replicas}x{lay.shard_size} mesh is lost: the job is at (epoch, step) "
                f"{target}, and {have} (every replica that held this shard is gone); "
                "restore the job from a checkpoint")  # recover_shards first waits for a holder to come back
        if plan is not None:
            plans[index] = plan
    return plans

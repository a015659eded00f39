"""Attaching the recorder to groups: by default to every ftc10d group.

A group is attached when it is created (``ftc10d.pg.observer.GROUP_CREATED``),
unless ``flight_recorder=False`` was passed or ``FTC10D_FLIGHT_RECORDER=0`` is
set. Attaching installs the op observer, an abort hook that dumps (so a
timeout or a peer failure leaves a dump holding the stuck op, not completed),
and the dump-on-signal handler.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Sequence

import torch

from time import time_ns

from ftc10d.flight_recorder.recorder import _DTYPE, _SHAPE, Entry, FlightRecorder, _frames, enabled_by_env, get_recorder
from ftc10d.pg import observer, torch_hooks
from ftc10d.pg.generation import Generation
from ftc10d.pg.process_group import ProcessGroup

logger = logging.getLogger("ftc10d")

#: The abort hook id the recorder uses; chosen far from ids users pick.
ABORT_HOOK_ID = 0x7FC10D

#: Our op names -> the names torch's fr_trace knows (its COLLECTIVES/P2P sets).
PROFILING_NAMES = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_into_tensor": "_all_gather_base",
    "gather": "gather",
    "gather_into_tensor": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
}

_PROFILING = {op: "gloo:" + name for op, name in PROFILING_NAMES.items()}

_groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


def generation_pg_name(pg: ProcessGroup, gen: Generation) -> str:
    return f"{pg.group_name}:{'init' if gen.uuid is None else gen.uuid}"


class _Observer:
    """Feeds the ring buffer from a group's issue path."""

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder

    def on_generation(self, pg: ProcessGroup, gen: Generation) -> None:
        if gen.fr_info is not None:
            return  # registered already (attach after creation, or attached again)
        name, desc = generation_pg_name(pg, gen), f"ftc10d {gen.label}"
        gen.fr_info = (name, desc)  # computed once per generation, read on every op
        self.recorder.register_generation(name, desc, gen.global_ranks)

    def on_issue(
        self,
        pg: ProcessGroup,
        gen: Generation,
        op: str,
        seq: int,
        p2p: bool,
        root: int,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        op_id: int,
    ) -> Entry:
        # The hot path: build the entry here rather than through FlightRecorder.record(),
        # saving a call frame and an argument shuffle on every op.
        info = gen.fr_info
        if info is None:  # attached while a reconfigure installed this generation
            self.on_generation(pg, gen)
            info = gen.fr_info
        name, desc = info
        if p2p:
            me = gen.rank
            peer = root if root >= 0 else me  # recv from any source: the peer is unknown
            profiling = f"gloo:send {me}->{peer}" if op == "send" else f"gloo:recv {me}<-{peer}"
            cseq, pseq = gen.collective_seq, seq
        else:
            profiling = _PROFILING.get(op) or "gloo:" + op
            cseq, pseq = seq, gen.p2p_seq
        rec = self.recorder
        rid = next(rec._ids)
        in_sizes, in_dtypes = list(map(_SHAPE, inputs)), list(map(_DTYPE, inputs))
        same = outputs is inputs
        e = Entry((
            rid, pg._group_id, name, desc, gen.uuid, cseq, pseq, op_id, profiling, time_ns(),
            in_sizes, in_dtypes,
            in_sizes if same else list(map(_SHAPE, outputs)), in_dtypes if same else list(map(_DTYPE, outputs)),
            "scheduled", None, None, False, pg._timeout_ms, p2p, _frames() if rec.stack_traces else [], None, None,
        ))
        rec._ring[rid % rec.capacity] = e
        return e


def attach(pg: ProcessGroup, recorder: Optional[FlightRecorder] = None) -> None:
    """Record ``pg``'s ops (idempotent)."""
    from ftc10d.flight_recorder.dump import install_signal_handler, _safe_dump

    if pg in _groups:
        return
    rec = recorder or get_recorder()
    obs = _Observer(rec)
    gen = pg.generation
    if gen is not None:  # attached to a configured group (idempotent: see on_generation)
        obs.on_generation(pg, gen)
    pg._observer = obs
    ref = weakref.ref(pg)

    def dump_on_abort() -> None:
        # A planned reconfigure of an idle configuration is no incident: only dump
        # when the abort interrupts something (a timeout, a failure, a stuck op).
        group = ref()
        gen = group.generation if group is not None else None
        if gen is not None and gen.abort_reason.startswith("reconfigured to") and not gen.has_pending():
            return
        _safe_dump()

    pg.register_abort_hook(ABORT_HOOK_ID, dump_on_abort)
    _groups.add(pg)
    install_signal_handler()


def detach(pg: ProcessGroup) -> None:
    """Stop recording ``pg``'s ops (idempotent); what was recorded stays in the buffer."""
    if pg not in _groups:
        return
    pg._observer = None
    pg.unregister_abort_hook(ABORT_HOOK_ID)
    _groups.discard(pg)


def _torch_flight_recorder_hook(pg: ProcessGroup) -> torch_hooks.TorchHookHandle:
    """torch's ``FlightRecorderHook.attach(pg)`` on an ftc10d group (ftc10d.pg.torch_hooks):
    its ``remove()`` detaches the recorder only if this call attached it (a group records
    by default; removing a hook must not cost it its abort dumps)."""
    attached_here = pg not in _groups
    attach(pg)
    return torch_hooks.TorchHookHandle("FlightRecorderHook", pg, detach if attached_here else lambda _pg: None)


def _on_group_created(pg: ProcessGroup, flight_recorder: Any) -> None:
    wanted = enabled_by_env() if flight_recorder is None else bool(flight_recorder)
    if wanted:
        attach(pg)


def poll_pending() -> None:
    """Let every attached group report completions it has not noticed yet."""
    for pg in list(_groups):
        gen = pg.generation
        if gen is not None:
            gen.poll()


observer.GROUP_CREATED.append(_on_group_created)
torch_hooks.ATTACH["FlightRecorderHook"] = _torch_flight_recorder_hook

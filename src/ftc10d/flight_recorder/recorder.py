"""The per-process ring buffer of operations, in torch's Flight Recorder terms.

One :class:`FlightRecorder` per process, shared by every ftc10d group, sized by
``TORCH_FR_BUFFER_SIZE`` (default 2000, like torch). The issue path of a group
calls :meth:`FlightRecorder.record` once per op: that is the whole hot-path
cost, so an entry stores what it needs cheaply (``torch.Size`` and dtype
objects, no tensors) and is turned into torch's dump fields only at dump time.

States are true, never guessed: an entry is ``completed`` only when its work
was seen complete (a successful ``wait()``, a future callback, or the
generation noticing it finished); a failed or aborted op keeps its
``scheduled`` state and gets an ``error`` ("timeout", "peer failure",
"aborted", ...), an ftc10d field that torch's analyzer ignores.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
import time
import traceback
from typing import Any, Optional, Sequence

import torch

DEFAULT_BUFFER_SIZE = 2000


FIELDS = (
    "record_id", "pg_id", "pg_name", "pg_desc", "uuid", "collective_seq_id", "p2p_seq_id", "op_id",
    "profiling_name", "time_created_ns", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
    "state", "time_discovered_started_ns", "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p",
    "frames", "error", "time_failed_ns",
)
_IDX = {name: i for i, name in enumerate(FIELDS)}
_STATE, _COMPLETED_NS, _RETIRED, _ERROR, _FAILED_NS = (
    _IDX["state"], _IDX["time_discovered_completed_ns"], _IDX["retired"], _IDX["error"], _IDX["time_failed_ns"]
)


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


class Entry(list):
    """One op, as a list in :data:`FIELDS` order (the cheapest object Python builds);
    mutated in place by completion, read by name at dump time."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[_IDX[name]]
        except KeyError:
            raise AttributeError(name) from None

    def complete(self) -> None:
        if not self[_RETIRED]:
            self[_STATE] = "completed"
            self[_COMPLETED_NS] = time.time_ns()
            self[_RETIRED] = True

    def fail(self, error: str) -> None:
        if not self[_RETIRED]:
            self[_ERROR] = error
            self[_FAILED_NS] = time.time_ns()
            self[_RETIRED] = True

    @property
    def settled(self) -> bool:
        return bool(self[_RETIRED])


def _frames() -> list[dict[str, Any]]:
    stack = traceback.extract_stack()[:-4]  # drop the recorder and issue-path frames
    return [{"name": f.name, "filename": f.filename, "line": f.lineno} for f in reversed(stack)]


class FlightRecorder:
    """A bounded ring of :class:`Entry`; memory is ``capacity`` entries, whatever runs."""

    def __init__(self, capacity: int = DEFAULT_BUFFER_SIZE, *, stack_traces: bool = False) -> None:
        self.capacity = max(1, int(capacity))
        self.stack_traces = stack_traces
        self._ring: list[Optional[Entry]] = [None] * self.capacity
        self._ids = itertools.count()
        self._lock = threading.Lock()  # only for snapshots; record() relies on the GIL
        #: pg_name -> (desc, global ranks), for the dump's pg_config
        self.pg_config: dict[str, tuple[str, tuple[int, ...]]] = {}

    def register_generation(self, pg_name: str, desc: str, global_ranks: Sequence[int]) -> None:
        self.pg_config[pg_name] = (desc, tuple(global_ranks))

    def record(
        self,
        pg_id: int,
        pg_name: str,
        pg_desc: str,
        uuid: Optional[int],
        collective_seq_id: int,
        p2p_seq_id: int,
        op_id: int,
        profiling_name: str,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        timeout_ms: int,
        is_p2p: bool,
    ) -> Entry:
        rid = next(self._ids)
        in_sizes, in_dtypes = list(map(_SHAPE, inputs)), list(map(_DTYPE, inputs))
        e = Entry((
            rid, pg_id, pg_name, pg_desc, uuid, collective_seq_id, p2p_seq_id, op_id, profiling_name,
            time.time_ns(), in_sizes, in_dtypes,
            in_sizes if outputs is inputs else list(map(_SHAPE, outputs)),
            in_dtypes if outputs is inputs else list(map(_DTYPE, outputs)),
            "scheduled", None, None, False, timeout_ms, is_p2p,
            _frames() if self.stack_traces else [], None, None,
        ))
        self._ring[rid % self.capacity] = e
        return e

    def entries(self) -> list[Entry]:
        """The live entries, oldest first."""
        with self._lock:
            ring = list(self._ring)
        live = [e for e in ring if e is not None]
        live.sort(key=lambda e: e.record_id)
        return live

    def reset(self) -> None:
        with self._lock:
            self._ring = [None] * self.capacity
            self.pg_config.clear()


_RECORDER: Optional[FlightRecorder] = None
_RECORDER_LOCK = threading.Lock()


def enabled_by_env() -> bool:
    """``FTC10D_FLIGHT_RECORDER=0`` (or ``TORCH_FR_BUFFER_SIZE=0``) turns recording off."""
    if os.environ.get("FTC10D_FLIGHT_RECORDER", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip() != "0"


def get_recorder() -> FlightRecorder:
    """The process's recorder, created on first use from the environment."""
    global _RECORDER
    if _RECORDER is None:
        with _RECORDER_LOCK:
            if _RECORDER is None:
                size = int(os.environ.get("TORCH_FR_BUFFER_SIZE", "") or DEFAULT_BUFFER_SIZE)
                stacks = os.environ.get("FTC10D_FR_STACK_TRACES", os.environ.get("TORCH_INCLUDE_STACK_TRACE", "0"))
                _RECORDER = FlightRecorder(size, stack_traces=stacks.strip().lower() in ("1", "true", "on", "yes"))
    return _RECORDER

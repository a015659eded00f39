"""Dumps in torch's Flight Recorder format (pickle) and as JSON, and what triggers them.

The pickle holds ``version, pg_config, pg_status, entries`` exactly as torch's
NCCL recorder writes them, so ``python -m torch.distributed.flight_recorder.fr_trace``
reads it. One file per rank, named ``<prefix><rank>`` where the prefix comes
from ``TORCH_FR_DUMP_TEMP_FILE`` or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (as in
torch), else ``~/.cache/ftc10d/flight_recorder/rank_``. ``rank`` is the
process's global rank: ``RANK`` if set, else its rank in the first ftc10d
group it made.

Every configuration of a group is its own process group in the dump, named
``<group>:<uuid>`` with the members' global ranks, because torch's analyzer
needs one fixed membership per group name; sequence numbers restart with each.

The JSON twin (``<dir>/ftc10d-fr-<rank>.json``) carries the same content plus
the ftc10d fields, for tools that should not unpickle anything.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import tempfile
import threading
import time
from typing import Any, Optional

import torch

from ftc10d.flight_recorder.recorder import Entry, FlightRecorder, get_recorder
from ftc10d.pg.c10d import process_rank

logger = logging.getLogger("ftc10d")

VERSION = "2.10"  # torch's Flight Recorder dump version these files follow
DEFAULT_SIGNAL = "SIGUSR2"

_dump_lock = threading.Lock()


def _dtype_name(dtype: torch.dtype) -> str:
    # torch's recorder writes c10 scalar type names: Float, Half, BFloat16, Long...
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
        torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype).replace("torch.", ""))


def dump_prefix() -> str:
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        value = os.environ.get(var)
        if value:
            return value
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ftc10d", "flight_recorder", "rank_")


def _entry_dict(e: Entry, *, extended: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "record_id": e.record_id,
        "pg_id": e.pg_id,
        "process_group": (e.pg_name, e.pg_desc),
        "collective_seq_id": e.collective_seq_id,
        "p2p_seq_id": e.p2p_seq_id,
        "op_id": e.op_id,
        "profiling_name": e.profiling_name,
        "time_created_ns": e.time_created_ns,
        "input_sizes": [list(s) for s in e.input_sizes],
        "input_dtypes": [_dtype_name(t) for t in e.input_dtypes],
        "output_sizes": [list(s) for s in e.output_sizes],
        "output_dtypes": [_dtype_name(t) for t in e.output_dtypes],
        "state": e.state,
        "time_discovered_started_ns": e.time_discovered_started_ns,
        "time_discovered_completed_ns": e.time_discovered_completed_ns,
        "retired": e.retired,
        "timeout_ms": e.timeout_ms,
        "is_p2p": e.is_p2p,
        "frames": e.frames,
    }
    if extended:
        d["uuid"] = e.uuid
        d["error"] = e.error
        d["time_failed_ns"] = e.time_failed_ns
    return d


def snapshot(recorder: Optional[FlightRecorder] = None, *, extended: bool = True) -> dict[str, Any]:
    """The dump as a dict (torch's keys; ``extended`` adds the ftc10d fields)."""
    from ftc10d.flight_recorder import hooks  # late: hooks imports this module

    hooks.poll_pending()
    rec = recorder or get_recorder()
    entries = rec.entries()
    pg_config = {
        name: {"name": name, "desc": desc, "ranks": "[" + ", ".join(str(r) for r in ranks) + "]"}
        for name, (desc, ranks) in list(rec.pg_config.items())
    }
    status: dict[str, dict[str, int]] = {}
    for e in entries:
        if e.is_p2p:
            continue
        s = status.setdefault(str(e.pg_id) + ":" + e.pg_name, {
            "last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1,
        })
        s["last_enqueued_collective"] = max(s["last_enqueued_collective"], e.collective_seq_id)
        if e.state == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], e.collective_seq_id)
    out: dict[str, Any] = {
        "version": VERSION,
        "comm_lib_version": "gloo",
        "pg_config": pg_config,
        "pg_status": status,
        "entries": [_entry_dict(e, extended=extended) for e in entries],
    }
    if extended:
        out["rank"] = process_rank()
        out["producer"] = "ftc10d"
        out["time_dumped_ns"] = time.time_ns()
    return out


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ftc10d-fr-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def dump(path: Optional[str] = None, *, json_too: bool = True) -> str:
    """Write this process's recorder in torch's format; return the path written.

    ``path`` defaults to ``<prefix><rank>`` (see the module docstring). The JSON
    twin goes beside it as ``ftc10d-fr-<rank>.json``.
    """
    rank = process_rank()
    target = path or f"{dump_prefix()}{rank}"
    with _dump_lock:
        data = snapshot(extended=True)
        torch_view = dict(data)
        ours = ("uuid", "error", "time_failed_ns")
        torch_view["entries"] = [{k: v for k, v in e.items() if k not in ours} for e in data["entries"]]
        for key in ("rank", "producer", "time_dumped_ns"):
            torch_view.pop(key, None)
        _atomic_write(target, pickle.dumps(torch_view))
        if json_too:
            json_path = os.path.join(os.path.dirname(os.path.abspath(target)), f"ftc10d-fr-{rank}.json")
            _atomic_write(json_path, json.dumps(data, default=str).encode())
    logger.info("flight recorder: dumped %d entries to %s", len(data["entries"]), target)
    return target


def _signal_number() -> Optional[int]:
    name = os.environ.get("FTC10D_FR_DUMP_SIGNAL", DEFAULT_SIGNAL).strip()
    if name.lower() in ("", "0", "none", "off"):
        return None
    if name.isdigit():
        return int(name)
    sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    if sig is None:
        logger.warning("FTC10D_FR_DUMP_SIGNAL=%r is not a signal name; no signal dump", name)
        return None
    return int(sig)


_signal_installed = False


def install_signal_handler() -> Optional[int]:
    """Dump on a signal (SIGUSR2 by default; ``FTC10D_FR_DUMP_SIGNAL`` to change or
    disable). Only from the main thread, and never over a handler someone else set."""
    global _signal_installed
    if _signal_installed or threading.current_thread() is not threading.main_thread():
        return None
    signum = _signal_number()
    if signum is None:
        return None
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        logger.info("flight recorder: signal %d already has a handler; not installing the dump handler", signum)
        return None

    def on_signal(_signum: int, _frame: Any) -> None:
        # A signal handler runs between bytecodes of the main thread; the dump
        # takes locks that main-thread code could hold, so write from a thread.
        threading.Thread(target=_safe_dump, name="ftc10d-fr-dump", daemon=True).start()

    signal.signal(signum, on_signal)
    _signal_installed = True
    return signum


def _safe_dump() -> None:
    try:
        dump()
    except Exception:
        logger.exception("flight recorder dump failed")

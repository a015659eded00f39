"""The ring buffer and dumps, in one process."""

from __future__ import annotations

import json
import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

import ftc10d
from ftc10d.flight_recorder import FlightRecorder, dump, get_recorder
from ftc10d.flight_recorder.analyze import load_dir
from tests import harness


def _record(rec: FlightRecorder, i: int):
    t = torch.zeros(3, dtype=torch.float16)
    return rec.record(0, "g:init", "desc", None, i, 0, i, "gloo:all_reduce", [t], [t], 1000, False)


def test_ring_wraps_around_and_stays_bounded() -> None:
    rec = FlightRecorder(capacity=5)
    for i in range(12):
        _record(rec, i)
    ids = [e.record_id for e in rec.entries()]
    assert ids == [7, 8, 9, 10, 11]
    assert len(rec._ring) == 5


def test_states_are_true_completed_only_once_failed_stays_not_completed() -> None:
    rec = FlightRecorder(capacity=4)
    done, failed = _record(rec, 1), _record(rec, 2)
    done.complete()
    failed.fail("timeout")
    failed.complete()  # a failed op never becomes completed
    assert (done.state, done.error, done.retired) == ("completed", None, True)
    assert (failed.state, failed.error) == ("scheduled", "timeout")
    assert done.time_discovered_completed_ns >= done.time_created_ns


def test_group_ops_are_recorded_and_dump_needs_no_arguments(tmp_path: os.PathLike, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", os.path.join(str(tmp_path), "rank_"))
    store = harness.host_store()
    pg = ftc10d.ProcessGroup(store, 0, 1, timeout=timedelta(seconds=10))
    quiet = ftc10d.ProcessGroup(dist.PrefixStore("quiet", store), 0, 1, flight_recorder=False)
    assert quiet._observer is None and pg._observer is not None
    before = len(get_recorder().entries())
    dist.all_reduce(torch.ones(2, dtype=torch.bfloat16), group=pg)
    dist.all_reduce(torch.ones(2), group=quiet)
    w = dist.all_reduce(torch.ones(2), group=pg, async_op=True)
    w.wait()
    entries = get_recorder().entries()
    assert len(entries) == before + 2
    assert all(e.state == "completed" for e in entries[-2:])
    path = dump()
    assert path == os.path.join(str(tmp_path), "rank_0")
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert data["version"] == "2.10" and set(data) >= {"version", "pg_config", "pg_status", "entries"}
    last = data["entries"][-2]
    assert last["profiling_name"] == "gloo:all_reduce"
    assert last["input_dtypes"] == ["BFloat16"] and last["input_sizes"] == [[2]]
    assert set(last) >= {
        "record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
        "time_created_ns", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state",
        "time_discovered_started_ns", "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p", "frames",
    }
    with open(os.path.join(str(tmp_path), "ftc10d-fr-0.json")) as f:
        twin = json.load(f)
    assert twin["entries"][-1]["uuid"] is None and twin["entries"][-1]["error"] is None
    assert load_dir(str(tmp_path))[0]["producer"] == "ftc10d"
    pg.shutdown()
    quiet.shutdown()

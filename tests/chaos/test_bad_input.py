"""Bad-input sweep: whatever arrives, a typed error (or the record ignored), and nothing changed.

Fuzzed with hypothesis where input is parsed: reconfigure handles and options
(``pg/handles.py``), membership records (``membership/records.py`` and the
record bodies of ``membership/agreement.py``), state-transfer skeletons and
headers (``train/state.py``, ``train/recovery.py``). Then real groups: reused
uuids, foreign/duplicate handles, mismatched shapes and dtypes across ranks, and
records signed with the wrong job token.

Found by this sweep and fixed (see docs/reliability.md): non-ASCII signatures
raised TypeError, a join record with ``"pid": Infinity`` raised OverflowError out
of ``propose()``, malformed skeletons raised KeyError/IndexError/TypeError.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ftc10d  # noqa: E402
from ftc10d.membership.agreement import Configuration, MemberInfo, cfg_key  # noqa: E402
from ftc10d.membership.records import Signer  # noqa: E402
from ftc10d.pg.handles import check_handle, new_handle, plan_reconfigure  # noqa: E402
from ftc10d.train import recovery  # noqa: E402
from ftc10d.train.state import StateFormatError, in_place_targets, pack, skeleton_sizes, unpack  # noqa: E402
from ftc10d.types import FTC10DError, InvalidOptionError, ReconfigureError  # noqa: E402
from tests import harness  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
T = timedelta(seconds=30)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
good_handles = st.builds(lambda: new_handle())
foreign_handles = st.sampled_from([
    "nccl://10.0.0.1:1234/0", "ftc10d/v2/host/1/0123456789abcdef", "ftc10d/v1/host/1/0123456789ABCDEF",
    "ftc10d/v1/ho st/1/0123456789abcdef", "ftc10d/v1/host/-1/0123456789abcdef", "ftc10d/v1//1/0123456789abcdef",
    "ftc10d/v1/host/1/0123456789abcdef\n", "", "ftc10d/v1/host/12345678901/0123456789abcdef",
]) | st.text(max_size=60)


# ----------------------------------------------------------------- handles


@FUZZ
@given(foreign_handles)
def test_handle_parser_accepts_exactly_well_formed_handles(text: str) -> None:
    try:
        assert check_handle(text) == text
    except ReconfigureError:
        return
    assert text.startswith("ftc10d/v1/") and text.count("/") == 4


@FUZZ
@given(st.lists(good_handles | foreign_handles, max_size=6), st.booleans(), st.integers() | st.text(max_size=4),
       st.booleans())
def test_reconfigure_options_are_validated_into_a_plan_or_a_typed_error(
        handles: list[str], dup: bool, uuid: Any, as_set: bool) -> None:
    own = new_handle()
    handles = [own] + handles + (handles[:1] if dup else [])
    opts = ftc10d.ReconfigureOptions(uuid, set(handles) if as_set else handles)  # type: ignore[arg-type]
    try:
        plan = plan_reconfigure(opts, own, T)
    except (ReconfigureError, InvalidOptionError):
        return
    assert isinstance(uuid, int) and -(2**63) <= uuid < 2**63
    assert len(set(plan.handles)) == len(plan.handles) and plan.handles[plan.rank] == own
    assert all(check_handle(h) for h in plan.handles)


# ------------------------------------------------------ membership records


@FUZZ
@given(st.binary(max_size=80), st.booleans())
def test_any_bytes_in_a_record_slot_decode_or_are_ignored(raw: bytes, signed: bool) -> None:
    signer = Signer("job-token" if signed else None)
    body = signer.decode("cfg/3", raw)
    assert body is None or isinstance(body, dict)
    beat = signer.decode_beat("hb/x", raw)
    assert beat is None or (isinstance(beat, int) and beat >= 0)


@FUZZ
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5), st.text(max_size=20) | json_values)
def test_records_with_a_bad_signature_are_ignored(body: dict[str, Any], sig: Any) -> None:
    signer = Signer("job-token")
    raw = json.dumps({"b": body, "s": sig}).encode()
    assert signer.decode("mem/x", raw) is None or sig == signer._mac("mem/x", json.dumps(
        body, sort_keys=True, separators=(",", ":")).encode())
    assert signer.decode_beat("hb/x", b"12:" + str(sig).encode()) is None


def test_wrong_job_token_records_are_ignored() -> None:
    mine, theirs = Signer("token-A"), Signer("token-B")
    body = {"kind": "member", "id": "m1", "handle": new_handle()}
    assert mine.decode("mem/m1", theirs.encode("mem/m1", body)) is None
    assert mine.decode("mem/m1", Signer(None).encode("mem/m1", body)) is None  # unsigned
    assert mine.decode("mem/m2", mine.encode("mem/m1", body)) is None  # copied to another key
    assert mine.decode("mem/m1", mine.encode("mem/m1", body)) == body
    assert mine.decode_beat("hb/m1", theirs.encode_beat("hb/m1", 5)) is None
    assert mine.decode_beat("hb/m1", b"5:\xff\xfe") is None  # used to raise TypeError
    assert mine.rejected >= 4


record_keys = st.sampled_from(["kind", "epoch", "uuid", "inc", "joins", "min", "members", "base", "removed", "added",
                               "digest", "id", "handle", "pid", "last_epoch", "last_rank", "last_inc", "host",
                               "reason"])


@FUZZ
@given(st.dictionaries(record_keys, json_values | st.just(float("inf")), max_size=9))
def test_record_bodies_parse_to_an_object_or_none(body: dict[str, Any]) -> None:
    cfg = Configuration.from_body({"kind": "config", **body}, 1)
    assert cfg is None or (cfg.epoch == 1 and len(set(cfg.members)) == cfg.size)
    info = MemberInfo.from_body({**body, "kind": "member", "id": "m"}, "m")
    assert info is None or isinstance(info.handle, str)


def test_a_join_record_with_infinity_is_ignored() -> None:
    """Was: OverflowError out of Agreement.propose(), which then could not change the configuration."""
    raw = json.dumps({"b": {"kind": "member", "id": "m", "handle": new_handle(), "pid": float("inf")}}).encode()
    body = Signer(None).decode("mem/m", raw)
    assert body is not None and MemberInfo.from_body(body, "m") is None


def test_a_configuration_signed_with_the_wrong_token_is_not_read() -> None:
    """(End to end with live members: tests/membership/test_stores.py::test_bad_signature_is_ignored_and_logged.)"""
    from ftc10d.membership import Agreement

    body = {"kind": "config", "epoch": 2, "uuid": 777, "inc": "i1", "members": [["m1", new_handle()]], "joins": 0,
            "min": 1}
    ours = Agreement(None, Signer("token-A"))  # type: ignore[arg-type]  (raw records given: no store read)
    assert ours.read_config(2, Signer("token-A").encode(cfg_key(2), body)) is not None
    assert ours.read_config(2, Signer("token-B").encode(cfg_key(2), body)) is None
    assert ours.read_config(2, Signer(None).encode(cfg_key(2), body)) is None
    assert ours.read_config(3, Signer("token-A").encode(cfg_key(2), body)) is None  # replayed at another epoch


# ------------------------------------------------------ state transfer


state_trees = st.recursive(
    st.none() | st.integers() | st.text(max_size=4) | st.fixed_dictionaries(
        {"T": st.integers(-2, 3) | st.text(max_size=2), "dtype": st.sampled_from(["float32", "int64", "nope", 3]),
         "shape": st.lists(st.integers(-3, 10**6), max_size=3) | st.text(max_size=3)}),
    lambda inner: st.fixed_dictionaries({"D": st.lists(st.lists(inner, max_size=3), max_size=3)})
    | st.fixed_dictionaries({"L": st.lists(inner, max_size=3) | inner})
    | st.fixed_dictionaries({"U": st.lists(inner, max_size=3)}) | st.dictionaries(st.text(max_size=2), inner),
    max_leaves=12,
)


@FUZZ
@given(state_trees, st.lists(st.integers(-100, 10**6) | st.text(max_size=2), max_size=4) | json_values,
       st.integers(-10, 10**6) | json_values)
def test_garbage_skeletons_raise_state_format_error(tree: Any, offsets: Any, nbytes: Any) -> None:
    buffer = pack({"w": torch.arange(8.0), "step": 3}).buffer
    doc = json.dumps({"format": "ftc10d-state-1", "tree": tree, "offsets": offsets, "nbytes": nbytes})
    local = {"w": torch.zeros(8), "step": 0}
    for fn in (lambda: skeleton_sizes(doc), lambda: unpack(doc, buffer), lambda: in_place_targets(doc, local)):
        try:
            fn()
        except StateFormatError:
            pass


@FUZZ
@given(st.binary(max_size=200))
def test_truncated_or_random_skeleton_text(raw: bytes) -> None:
    packed = pack({"w": torch.arange(8.0)})
    for text in (raw.decode(errors="replace"), packed.skeleton[: len(raw) % max(len(packed.skeleton), 1)]):
        with pytest.raises(StateFormatError):
            unpack(text, packed.buffer[: len(raw)])


class _FakePeer:
    """A group of two where rank 1 receives what a (broken) source 0 would send: a header, then
    a skeleton, then buffer bytes, each a recv() of a tensor."""

    def __init__(self, messages: list[torch.Tensor]) -> None:
        self.messages = list(messages)

    def rank(self) -> int:
        return 1

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        msg = self.messages.pop(0)
        tensors[0].copy_(msg[: tensors[0].numel()].to(tensors[0].dtype))

        class _Done:
            def wait(self) -> bool:
                return True

        return _Done()


@pytest.mark.parametrize("header, skeleton, why", [
    ([1 << 40, 10], b"", "announces"),                      # oversized: refused before allocating a TiB
    ([-5, 10], b"", "announces"),
    ([3, -1], b"abc", "announces"),
    ([4, 0], b"\xff\xfe\xfd\xfc", "UTF-8"),
    ([9, 0], b"{\"a\": 1}", "format"),
    ([40, 64], b'{"format":"ftc10d-state-1","tree":{"T":0}', "not JSON"),  # truncated
])
def test_broken_state_transfer_headers_and_skeletons(header: list[int], skeleton: bytes, why: str) -> None:
    plan = recovery.Plan(0, [1], 5, [5, 0], [True, False])
    peer = _FakePeer([torch.tensor(header, dtype=torch.int64),
                      torch.frombuffer(bytearray(skeleton.ljust(max(header[0], 0) if 0 < header[0] < 4096 else 0,
                                                                b" ")) or bytearray(1), dtype=torch.uint8)])
    with pytest.raises(StateFormatError, match=why):
        recovery.transfer(peer, plan, lambda: {})


# ------------------------------------------------------ real groups


def _reused_uuid_and_foreign_handles(rank: int, world: int, port: int) -> dict[str, Any]:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=T)
    handles = harness.exchange(store, "h", rank, pg.get_reconfigure_handle(), world)
    ftc10d.reconfigure(11, handles, group=pg)
    seen = {}
    for name, opts, exc in [
        ("reused uuid", ftc10d.ReconfigureOptions(11, handles), ftc10d.UuidReusedError),
        ("foreign handle", ftc10d.ReconfigureOptions(12, handles + ["nccl://10.0.0.1:29500/3"]),
         ftc10d.InvalidHandleError),
        ("duplicate", ftc10d.ReconfigureOptions(13, handles + handles[:1]), ftc10d.DuplicateHandleError),
        ("handle of another job", ftc10d.ReconfigureOptions(14, [new_handle()]), ftc10d.MissingHandleError),
    ]:
        try:
            pg.reconfigure(opts)
            seen[name] = "accepted"
        except exc as e:
            seen[name] = type(e).__name__
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)  # nothing changed: same configuration, still working
        assert pg.uuid == 11 and t.tolist() == [float(world)] * 2, (name, pg.uuid, t)
    return seen


def test_reused_uuid_and_foreign_handles_on_a_live_group() -> None:
    results = harness.run(_reused_uuid_and_foreign_handles, 2, timeout=120)
    for r in results.values():
        assert r == {"reused uuid": "UuidReusedError", "foreign handle": "InvalidHandleError",
                     "duplicate": "DuplicateHandleError", "handle of another job": "MissingHandleError"}, r


def _mismatched(rank: int, world: int, port: int, case: str) -> str:
    store = harness.client_store(port)
    pg = ftc10d.ProcessGroup(store, rank, world, timeout=timedelta(seconds=5), check_collectives=True)
    t = torch.ones(4 + rank) if case == "shape" else torch.ones(4, dtype=(torch.float32, torch.float64)[rank])
    try:
        dist.all_reduce(t, group=pg)
    except FTC10DError as exc:
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)  # the group is unchanged and still computes
        assert t.tolist() == [2.0, 2.0]
        return type(exc).__name__
    return "no error"


@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_mismatched_shapes_or_dtypes_across_ranks_give_a_typed_error(case: str) -> None:
    job = harness.start(_mismatched, 2, case)
    try:
        deadline = time.monotonic() + 60
        while any(p.exitcode is None for p in job.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        died = [r for r, p in enumerate(job.procs) if p.exitcode not in (0, 1)]
        assert not died, f"rank(s) {died} died: exit codes {[p.exitcode for p in job.procs]}"
        results = job.collect(timeout=10)
    finally:
        job.close()
    assert set(results.values()) == {"CollectiveMismatchError"}, results

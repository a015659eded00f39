"""Configuration records: full and delta encodings, their checks, and the shared decode.

Big configurations (more than ``FULL_LIMIT`` members) are written as deltas against their
predecessor; a reader applies only what changed. Every shape a forger or a bug could write
must be refused (a delta that duplicates a kept member or handle, a wrong base, a digest that
does not match), and a record is decoded once per process however many agents read it.
"""

from __future__ import annotations

import json
from typing import Optional

import pytest

from ftc10d.membership import records
from ftc10d.membership.agreement import FULL_LIMIT, Configuration, cfg_key
from ftc10d.membership.records import Signer
from ftc10d.types import MembershipError

N = FULL_LIMIT + 36


def _cfg(epoch: int, ids: list[str], *, full_epoch: int = 1) -> Configuration:
    return Configuration(epoch=epoch, uuid=100 + epoch, handles=tuple(f"h-{m}" for m in ids),
                         members=tuple(ids), incarnation="inc", full_epoch=full_epoch)


def _ids(n: int, node: str = "n0") -> list[str]:
    return [f"{node}.{i:04d}" for i in range(n)]


def test_delta_round_trip_removes_and_appends_in_order() -> None:
    prev = _cfg(5, _ids(N))
    ids = [m for m in prev.members if m not in ("n0.0003", "n0.0050")] + ["n1.0000", "n1.0001"]
    nxt = _cfg(6, ids)
    body = nxt.to_body(prev)
    assert "members" not in body and body["removed"] == ["n0.0003", "n0.0050"]
    got = Configuration.from_body(json.loads(json.dumps(body)), 6, prev)
    assert got is not None
    assert got.members == nxt.members and got.handles == nxt.handles
    assert got.full_epoch == prev.full_epoch
    # The delta's digest is chained from its base's (O(change) to check), the list the same.
    assert got.digest == body["digest"] != prev.digest
    assert got.list_digest == nxt.list_digest
    assert got.rank_of("h-n1.0001") == N - 1  # appended after the N - 2 survivors
    assert got.handle_of("n0.0004") == "h-n0.0004" and got.handle_of("n0.0003") is None


def test_small_configurations_are_written_in_full() -> None:
    prev = _cfg(5, _ids(8))
    body = _cfg(6, _ids(7)).to_body(prev)
    assert "members" in body
    assert Configuration.from_body(body, 6, None) is not None


def test_bad_deltas_are_refused() -> None:
    prev = _cfg(5, _ids(N))
    good = _cfg(6, list(prev.members[1:]) + ["n1.0000"]).to_body(prev)

    def variant(**change: object) -> dict:
        body = dict(good)
        body.update(change)
        return body

    # An added member that is still a member, or a handle still in use: two ranks, one identity.
    assert Configuration.from_body(variant(added=[["n0.0002", "h-new"]]), 6, prev) is None
    assert Configuration.from_body(variant(added=[["n9.0000", "h-n0.0002"]]), 6, prev) is None
    assert Configuration.from_body(variant(added=[["n9.0000", "x"], ["n9.0000", "y"]]), 6, prev) is None
    assert Configuration.from_body(variant(added=[["n9.0000", 7]]), 6, prev) is None
    assert Configuration.from_body(variant(removed="n0.0000"), 6, prev) is None
    # The wrong base, a missing base, another incarnation.
    assert Configuration.from_body(good, 6, None) is None
    assert Configuration.from_body(variant(base=4), 6, prev) is None
    assert Configuration.from_body(good, 7, prev) is None
    other = Configuration(epoch=5, uuid=1, handles=prev.handles, members=prev.members, incarnation="other")
    assert Configuration.from_body(good, 6, other) is None
    # A base with different members: the digest does not reproduce.
    moved = _cfg(5, list(reversed(prev.members)))
    assert Configuration.from_body(good, 6, moved) is None
    # A base with the same list but another history (its digest chained differently).
    rechained = Configuration(epoch=5, uuid=prev.uuid, handles=prev.handles, members=prev.members,
                              incarnation="inc", chain_digest="0" * 32)
    assert Configuration.from_body(good, 6, rechained) is None
    assert Configuration.from_body(variant(digest="0" * 32), 6, prev) is None
    assert Configuration.from_body(variant(digest=None), 6, prev) is None
    # A full record's list digest is checked; its chain, if any, must be a string.
    full = _cfg(6, list(prev.members[1:])).to_body()
    assert Configuration.from_body(full, 6) is not None
    assert Configuration.from_body({**full, "digest": "0" * 32}, 6) is None
    assert Configuration.from_body({**full, "chain": 7}, 6) is None


def test_a_removed_members_handle_may_be_reused() -> None:
    prev = _cfg(5, _ids(N))
    ids = list(prev.members[1:]) + ["n1.0000"]
    nxt = Configuration(epoch=6, uuid=7, members=tuple(ids), incarnation="inc",
                        handles=tuple(f"h-{m}" for m in prev.members[1:]) + ("h-n0.0000",))
    got = Configuration.from_body(nxt.to_body(prev), 6, prev)
    assert got is not None and got.handle_of("n1.0000") == "h-n0.0000"


def test_a_record_is_decoded_once_per_process_and_forgeries_are_not(tmp_path: object) -> None:
    from ftc10d.membership.agreement import Agreement
    from ftc10d.membership.tcp import Coordinator

    signer = Signer("job-token")
    prev = _cfg(1, _ids(N), full_epoch=1)
    nxt = _cfg(2, list(prev.members[2:]))
    with Coordinator(detect=False, notify=False, token="job-token") as co:
        a = Agreement(co.membership_store(), Signer("job-token"))
        b = Agreement(co.membership_store(), Signer("job-token"))
        raw1 = signer.encode(cfg_key(1), prev.to_body(None))
        raw2 = signer.encode(cfg_key(2), nxt.to_body(prev))
        first = a.read_config(1, raw=raw1)
        assert first is not None and first.members == prev.members
        one = a.read_config(2, raw=raw2)
        # b never saw epoch 1: without the shared decode it would have to read its base.
        two = b.read_config(2, raw=raw2)
        assert one is not None and two is one
        # Another job's key does not share it, and a forged copy is refused.
        c = Agreement(co.membership_store(), Signer("another-token"))
        assert c.read_config(2, raw=raw2) is None
        forged = raw2.replace(b'"uuid":102', b'"uuid":103')
        assert forged != raw2
        assert Agreement(co.membership_store(), Signer("job-token")).read_config(2, raw=forged) is None


def test_big_chains_are_deltas_with_a_full_copy_aside_every_full_every_epochs() -> None:
    """Readers that follow the chain read only deltas (a periodic full record in the chain was
    ~2 MB at 32,768 ranks, read by every node); a reader with no base (a joiner) finds its base
    in the full copy written every FULL_EVERY epochs, without walking to the first record."""
    from ftc10d.membership import agreement
    from ftc10d.membership.agreement import FULL_EVERY, Agreement, snapshot_key
    from ftc10d.membership.store import requests_made
    from ftc10d.membership.tcp import Coordinator

    signer = Signer("t")
    with Coordinator(detect=False, notify=False, token="t") as co:
        writer = Agreement(co.membership_store(), signer)
        ids = _ids(N)
        prev = None
        last = FULL_EVERY * 2 + 5
        for e in range(1, last + 1):
            cfg = Configuration(epoch=e, uuid=1000 + e, handles=tuple(f"h-{m}" for m in ids), members=tuple(ids),
                                incarnation="inc")
            ok, got = writer._install(cfg, prev)
            assert ok and got is not None
            prev = got
            ids = ids[1:] + [f"n{e + 1}.0000"]
        store = co.membership_store()
        kinds = {e: "members" in signer.decode(cfg_key(e), store.get(cfg_key(e))) for e in range(1, last + 1)}
        assert kinds[1] and not any(kinds[e] for e in range(2, last + 1)), kinds
        snaps = [e for e in range(1, last + 1) if store.get(snapshot_key(e)) is not None]
        assert snaps == [1 + FULL_EVERY, 1 + 2 * FULL_EVERY], snaps
        # A joiner: no base cached. It reads back to the last full copy, not to epoch 1.
        agreement._DECODED.clear()  # this process decoded nothing of it: a real joiner's position
        joiner = Agreement(co.membership_store(), Signer("t"))
        before = requests_made()
        top = joiner.read_config(last)
        reads = requests_made() - before
        assert top is not None and top.members == prev.members and top.digest == prev.digest
        assert reads <= 2 * (last - snaps[-1]) + 4, reads
        # A forged full copy is not a base: the joiner walks the chain instead.
        store.put(snapshot_key(snaps[-1]), Signer("forger").encode(snapshot_key(snaps[-1]), prev.to_body()))
        agreement._DECODED.clear()
        before = requests_made()
        again = Agreement(co.membership_store(), Signer("t")).read_config(last)
        assert again is not None and again.members == prev.members
        assert requests_made() - before > reads  # it did walk further back


def test_a_32768_rank_configuration_fits_one_record_and_an_oversized_one_is_refused_where_written() -> None:
    # A full record of 4,096 nodes x 8 ranks with real-looking ids and handles is ~2 MB: it was
    # refused by every reader when the limit was 1 MiB (found by membership_scale at 4,096 nodes).
    signer = Signer("tok")
    ids = [f"{n:016x}.{r:04d}" for n in range(4096) for r in range(8)]
    cfg = Configuration(epoch=1, uuid=7, handles=tuple(f"ftc10d/v1/node-{i // 8:05d}.cluster/{40000 + i}/{i:016x}"
                                                       for i in range(len(ids))),
                        members=tuple(ids), incarnation="inc", full_epoch=1)
    raw = signer.encode(cfg_key(1), cfg.to_body(None))
    # Stored deflated (every node reads it at once from one store): a third of the JSON or less.
    text = json.dumps({"b": cfg.to_body(None)}, separators=(",", ":")).encode()
    assert len(text) > 2_000_000 and raw[:1] == b"z" and len(raw) < len(text) // 3, (len(text), len(raw))
    body = signer.decode(cfg_key(1), raw)
    assert body is not None
    got = Configuration.from_body(body, 1, None)
    assert got is not None and got.digest == cfg.digest and got.size == len(ids)
    # Past the limit: a typed error at the writer, naming the size and the limit.
    with pytest.raises(MembershipError, match="over the limit"):
        signer.encode(cfg_key(2), {"members": ["x" * 1000] * (records.MAX_RECORD_BYTES // 1000 + 1)})


def test_report_exit_reads_the_chain_from_the_configuration_the_caller_holds() -> None:
    """A launcher's node agent holds the configuration: its ``report_exit`` reads the chain from
    there (a few small records), not from the last full copy (at 32,768 ranks a cold read took
    ~100 ms of the exit's path). A stale configuration (older epochs since) still leads to the
    latest, and the removal is the same as a cold reader's."""
    from ftc10d.membership import agreement
    from ftc10d.membership.agreement import FULL_EVERY, Agreement
    from ftc10d.membership.tcp import Coordinator, TCPMembershipStore

    signer = Signer("t")
    with Coordinator(detect=False, notify=False, token="t") as co:
        writer = Agreement(co.membership_store(), signer)
        ids = _ids(N)
        chain = []
        prev = None
        for e in range(1, FULL_EVERY + 6):
            cfg = Configuration(epoch=e, uuid=1000 + e, handles=tuple(f"h-{m}" for m in ids), members=tuple(ids),
                                incarnation=writer.incarnation())
            ok, got = writer._install(cfg, prev)
            assert ok and got is not None
            chain.append(got)
            prev = got
            ids = ids[1:] + [f"n{e + 1}.0000"]
        from ftc10d.membership.agreement import KEY_START

        # The chain's start, as propose_first writes it (the latest is looked for from there).
        start = {"kind": "start", "epoch": 1, "inc": chain[0].incarnation}
        writer.store.put(KEY_START, signer.encode(KEY_START, start))
        top = chain[-1]
        gone = [top.handles[5], top.handles[6], top.handles[7]]

        class Recording(TCPMembershipStore):
            """Names the full records (a 2-MB read at 32,768 ranks) this reader fetched."""

            full: list[str] = []

            def get(self, key: str) -> Optional[bytes]:
                raw = super().get(key)
                if raw is not None and b'"members"' in raw:
                    self.full.append(key)
                return raw

        agreement._DECODED.clear()  # as a process that decoded none of it
        warm_store = Recording(co.host, co.port)
        warm = Agreement(warm_store, Signer("t")).report_exit(gone[0], known=top)
        assert warm.changed and warm.config is not None and warm.config.epoch == top.epoch + 1
        assert gone[0] not in warm.config.handle_set and warm.config.size == top.size - 1
        assert warm_store.full == [], warm_store.full  # deltas only

        agreement._DECODED.clear()
        cold_store = Recording(co.host, co.port)
        cold_store.full = []
        cold = Agreement(cold_store, Signer("t")).report_exit(gone[1])
        assert cold.changed and cold.config is not None and cold.config.epoch == top.epoch + 2
        assert cold_store.full, "a reader with no configuration starts from a full record"

        # Known but stale (two epochs behind): the latest is still found, nothing is undone.
        agreement._DECODED.clear()
        stale = Agreement(co.membership_store(), Signer("t")).report_exit(gone[2], known=top)
        assert stale.changed and stale.config is not None and stale.config.epoch == top.epoch + 3
        assert not set(gone) & stale.config.handle_set and stale.config.size == top.size - 3


def test_big_records_are_stored_deflated_and_bad_deflated_records_are_refused() -> None:
    """Records over ``COMPRESS_OVER`` are zlib-deflated behind a ``z``; small ones stay plain JSON
    (the usual job's records are unchanged). A deflated record is checked like any other (its
    signature covers the inflated body), and one that is corrupt, truncated or inflates past
    ``MAX_RECORD_BYTES`` is refused without being inflated further."""
    import zlib

    signer = Signer("tok")
    small = signer.encode(cfg_key(1), _cfg(1, _ids(8)).to_body(None))
    assert small[:1] == b"{"
    big_cfg = _cfg(1, _ids(4000))
    big = signer.encode(cfg_key(1), big_cfg.to_body(None))
    assert big[:1] == b"z" and len(zlib.decompress(big[1:])) > records.COMPRESS_OVER
    body = signer.decode(cfg_key(1), big)
    assert body is not None and Configuration.from_body(body, 1, None) == big_cfg
    # The signature covers the key and the inflated body: moved to another key, it is refused.
    assert signer.decode(cfg_key(2), big) is None
    # Another job's (another token's) deflated record does not verify either.
    assert Signer("other").decode(cfg_key(1), big) is None

    refused = signer.rejected
    inner = zlib.decompress(big[1:])
    tampered = b"z" + zlib.compress(inner.replace(b"n0.0001", b"n0.9999", 1), 1)
    corrupt = big[:40] + bytes([big[40] ^ 0xFF]) + big[41:]
    truncated = big[: len(big) // 2]
    bomb = b"z" + zlib.compress(b"{" + b" " * (records.MAX_RECORD_BYTES + 10), 9)
    assert len(bomb) < 100_000  # small on the wire, 32 MiB inflated
    for bad in (tampered, corrupt, truncated, bomb, b"z", b"znot zlib"):
        assert signer.decode(cfg_key(1), bad) is None
    assert signer.rejected == refused + 6


def test_a_32768_rank_first_configuration_is_read_back_from_a_real_store() -> None:
    """The job's first configuration at 4,096 nodes x 8 ranks goes through a real TCPStore
    deflated (~0.5 MB instead of ~2 MB) and a reader in another process's shoes (a fresh
    Agreement) gets the same ordered member list."""
    from ftc10d.membership.agreement import Agreement
    from ftc10d.membership.tcp import Coordinator

    signer = Signer("t")
    ids = [f"{n:016x}.{r:016x}" for n in range(4096) for r in range(8)]
    cfg = Configuration(epoch=1, uuid=9, handles=tuple(f"ftc10d/v1/node-{i // 8:05d}.cluster/{40000 + i}/{i:016x}"
                                                       for i in range(len(ids))),
                        members=tuple(ids), incarnation="x", full_epoch=1)
    with Coordinator(detect=False, notify=False, token="t") as co:
        writer = Agreement(co.membership_store(), signer)
        cfg = Configuration(**{**cfg.__dict__, "incarnation": writer.incarnation()})
        ok, _ = writer._install(cfg, None)
        assert ok
        raw = co.membership_store().get(cfg_key(1))
        assert raw is not None and raw[:1] == b"z" and len(raw) < 800_000, len(raw or b"")
        got = Agreement(co.membership_store(), Signer("t")).read_config(1)
        assert got is not None and got.members == cfg.members and got.handles == cfg.handles


def test_units_derived_from_the_base_equal_the_units_computed_from_the_list() -> None:
    """A delta's configuration takes its heartbeat units from its base's (O(units)); they
    must be exactly what the whole list gives, in the same order, for any change."""
    import random

    rng = random.Random(7)
    ids = [f"n{i // 4:03d}.{i:04d}" for i in range(4 * 40)]
    rng.shuffle(ids)  # a node's members are not contiguous
    prev = _cfg(1, ids)
    prev.units  # computed, as an agent's current configuration has them
    fresh = 0
    for epoch in range(2, 60):
        members = list(prev.members)
        for m in rng.sample(members, rng.randint(0, 6)):
            members.remove(m)
        members += [f"n{rng.randint(0, 60):03d}.{1000 + epoch * 10 + k:04d}" for k in range(rng.randint(0, 5))]
        nxt = _cfg(epoch, members)
        got = Configuration.from_body(json.loads(json.dumps(nxt.to_body(prev))), epoch, prev)
        assert got is not None and got.members == nxt.members
        derived = "units" in got.__dict__
        fresh += not derived
        expected = Configuration(epoch=epoch, uuid=1, handles=got.handles, members=got.members, incarnation="inc")
        assert got.units == expected.units and list(got.units) == list(expected.units), epoch
        prev = got
    assert fresh < 58  # most were derived

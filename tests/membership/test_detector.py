"""``LapseDetector``: lapses judged between reads on streamed beats (pure: no store).

The coordinator's detector reads every heartbeat every ``timeout / 40`` and, between reads,
judges on the beats the node agents stream to it (:mod:`ftc10d.membership.notify`). A streamed
beat may only make the detector's clock more exact: a forged, stale or unknown one changes
nothing, and nobody is judged when the detector's own reads have stalled.
"""

from __future__ import annotations

from ftc10d.membership.agreement import hb_key
from ftc10d.membership.detector import LapseDetector
from ftc10d.membership.records import Signer

T = 1.0


def _beat(signer: Signer, mid: str, n: int) -> bytes:
    return signer.encode_beat(hb_key(mid), n)


def test_a_streamed_beat_counts_from_its_arrival_and_lapses_are_judged_between_reads() -> None:
    s = Signer("job")
    d = LapseDetector(s, T)
    ids = ["a", "b"]
    assert d.observe(ids, [_beat(s, "a", 1), _beat(s, "b", 1)], 0.0) == []  # first sight: grace
    assert d.observe(ids, [_beat(s, "a", 2), _beat(s, "b", 2)], 0.1) == []
    d.saw("a", _beat(s, "a", 3), 0.2)  # a beat again, streamed: first seen at 0.2, not at a read
    assert d.observe(ids, [_beat(s, "a", 3), _beat(s, "b", 2)], 0.4) == []  # same record: kept at 0.2
    assert d.judge(0.45) == []
    assert d.judge(0.1 + T + 0.01) == []  # the reads stalled (last one > timeout / 2 ago): nobody judged
    assert d.observe(ids, [_beat(s, "a", 3), _beat(s, "b", 2)], 0.9) == []
    assert d.judge(0.1 + T + 0.01) == ["b"]  # b's last counter first seen at 0.1
    assert sorted(d.judge(0.2 + T + 0.01)) == ["a", "b"]


def test_forged_stale_and_unknown_streamed_beats_change_nothing() -> None:
    s = Signer("job")
    d = LapseDetector(s, T)
    d.observe(["a"], [_beat(s, "a", 5)], 0.0)
    d.observe(["a"], [_beat(s, "a", 5)], 0.3)
    d.saw("a", Signer("forger").encode_beat(hb_key("a"), 9), 0.4)  # bad signature
    d.saw("a", _beat(s, "a", 4), 0.4)  # an older counter (a replay)
    d.saw("x", _beat(s, "x", 1), 0.4)  # not watched
    d.saw("a", b"garbage", 0.4)
    assert d.judge(0.5) == []
    assert d.judge(T + 0.01) == []  # last read at 0.3: more than half a timeout ago
    d.observe(["a"], [_beat(s, "a", 5)], 0.8)
    assert d.judge(T + 0.01) == ["a"]  # still judged from its first sight at 0.0
    assert "x" not in d.judge(T + 0.01)


def test_an_unchanged_record_is_judged_like_a_verified_one() -> None:
    """Reads that return the same bytes skip verifying them again; the lapse is the same."""
    s = Signer("job")
    d = LapseDetector(s, T)
    raw = _beat(s, "a", 1)
    assert d.observe(["a"], [raw], 0.0) == []
    for t in (0.25, 0.5, 0.75, 1.0):
        assert d.observe(["a"], [raw], t) == []
    assert d.observe(["a"], [raw], 1.05) == ["a"]
    assert d.observe(["a"], [None], 1.1) == ["a"]  # vanished (an expired lease): at once

"""Kill, freeze and rejoin, on both backends: 4 real ranks with real ProcessGroups.

Each rank allreduces in a loop and recovers through membership only
(``Member.sync``): nobody tells the survivors who died.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests import harness
from tests.membership.conftest import etcd_spec, same_config, tcp_spec, wait_states
from tests.membership.workers import pg_worker, short_sync_worker

BACKENDS = ["tcp", "etcd"]


@pytest.fixture(params=BACKENDS)
def spec(request: Any) -> dict[str, Any]:
    if request.param == "tcp":
        return tcp_spec(request.getfixturevalue("coordinator"))
    return etcd_spec(request.getfixturevalue("etcd1"))


def _final_agree(results: dict[int, Any]) -> tuple[int, int, list[str]]:
    finals = {r: tuple(res["history"][-1][:2]) + (tuple(res["history"][-1][2]),) for r, res in results.items()}
    assert len(set(finals.values())) == 1, f"survivors ended on different configurations: {finals}"
    epoch, uuid, handles = next(iter(finals.values()))
    return epoch, uuid, list(handles)


def test_kill_one_of_four(spec: dict[str, Any]) -> None:
    job = harness.start(pg_worker, 4, spec, {"expected": 4})
    try:
        st = wait_states(job.store, [0, 1, 2, 3], lambda s: same_config(s, 4, min_steps=3), 60, "4 ranks running")
        before = st[0]["uuid"]
        victim = st[2]["handle"]
        t0 = time.monotonic()
        job.signal(2, signal.SIGKILL)
        st = wait_states(job.store, [0, 1, 3], lambda s: same_config(s, 3, not_uuid=before), 30,
                         "the survivors to agree and reconfigure without rank 2")
        took = time.monotonic() - t0
        steps = {r: s["steps"] for r, s in st.items()}
        wait_states(job.store, [0, 1, 3], lambda s: all(s[r]["steps"] >= steps[r] + 5 for r in s), 30,
                    "the survivors to carry on")
        job.store.set("test/stop", "1")
        results = job.collect([0, 1, 3], timeout=60)
    finally:
        job.close()
    epoch, uuid, handles = _final_agree(results)
    assert victim not in handles and len(handles) == 3
    assert uuid != before
    # The data path told them first: a PeerFailureError, then the new configuration.
    assert any(e[1] == "error" for r in results for e in results[r]["events"]), results
    assert took < 10, f"recovery took {took:.1f} s"


def test_a_member_whose_training_thread_hangs_is_removed_after_missing_two_rendezvous(coordinator: Any) -> None:
    """Chaos finding 15: a member's training thread hung while its heartbeat went on; the
    others renewed the same membership every rendezvous timeout for the rest of the trial.
    A member that misses two rendezvous in a row of the newest configuration is removed."""
    opts = {"expected": 4, "hang": {"2": "test/hang"}, "pg_timeout": 3, "rendezvous_timeout": 3.0}
    job = harness.start(pg_worker, 4, tcp_spec(coordinator), opts)
    try:
        st = wait_states(job.store, [0, 1, 2, 3], lambda s: same_config(s, 4, min_steps=3), 60, "4 ranks running")
        before, hung = st[0]["uuid"], st[2]["handle"]
        t0 = time.monotonic()
        job.store.set("test/hang", "1")
        st = wait_states(job.store, [0, 1, 3], lambda s: same_config(s, 3, not_uuid=before, min_steps=3), 90,
                         "the others to remove the hung member and carry on")
        took = time.monotonic() - t0
        print(f"hung training thread -> removed and training again: {took:.2f} s")
        job.store.set("test/stop", "1")
        results = job.collect([0, 1, 3], timeout=60)
    finally:
        job.close()
    epoch, uuid, handles = _final_agree(results)
    assert hung not in handles and len(handles) == 3
    # an op timeout (3 s), then two rendezvous timeouts (2 s each) and agreement: well under 60 s
    assert took < 60, f"removing the hung member took {took:.1f} s"


def test_kill_and_a_join_at_once_do_not_stall_the_survivors(coordinator: Any) -> None:
    """A removal and an admission agreed milliseconds apart: a survivor that adopts the
    second before its rendezvous for the first must not leave the others waiting for it
    until the rendezvous timeout (30 s here): the stale rendezvous is given up."""
    # rank 3 is slow between steps, so it finds both changes at once and goes straight to the second
    opts = {"expected": 4, "hold": {"4": "test/join"}, "intervals": {"3": 0.3}, "rendezvous_timeout": 30.0}
    job = harness.start(pg_worker, 5, tcp_spec(coordinator), opts)
    try:
        st = wait_states(job.store, [0, 1, 2, 3], lambda s: same_config(s, 4, min_steps=3), 60, "4 ranks running")
        before, victim = st[0]["uuid"], st[2]["handle"]
        t0 = time.monotonic()
        job.signal(2, signal.SIGKILL)
        job.store.set("test/join", "1")
        st = wait_states(job.store, [0, 1, 3, 4], lambda s: same_config(s, 4, not_uuid=before, min_steps=1), 60,
                         "the survivors and the joiner on one configuration")
        took = time.monotonic() - t0
        print(f"kill + join -> one configuration of 4: {took:.2f} s")
        job.store.set("test/stop", "1")
        results = job.collect([0, 1, 3, 4], timeout=60)
    finally:
        job.close()
    epoch, uuid, handles = _final_agree(results)
    assert len(handles) == 4 and victim not in handles and results[4]["handle"] in handles
    assert took < 10, f"survivors and joiner needed {took:.1f} s: a stale rendezvous was waited out"


def test_freeze_fence_rejoin(spec: dict[str, Any]) -> None:
    job = harness.start(pg_worker, 4, spec, {"expected": 4, "rejoin": True})
    try:
        st = wait_states(job.store, [0, 1, 2, 3], lambda s: same_config(s, 4, min_steps=3), 60, "4 ranks running")
        before, frozen_member = st[0]["uuid"], st[3]["member"]
        job.signal(3, signal.SIGSTOP)
        t0 = time.monotonic()
        st = wait_states(job.store, [0, 1, 2], lambda s: same_config(s, 3, not_uuid=before), 30,
                         "the survivors to remove the frozen rank")
        removed_after = time.monotonic() - t0
        shrunk = st[0]["uuid"]
        time.sleep(0.3)
        job.signal(3, signal.SIGCONT)
        st = wait_states(job.store, [0, 1, 2, 3],
                         lambda s: (same_config(s, 4, not_uuid=shrunk) and s[3].get("fenced") == 1
                                    and s[0]["uuid"] != before),
                         60, "the frozen rank to be fenced, rejoin as a new member and be admitted")
        assert st[3]["member"] != frozen_member
        job.store.set("test/stop", "1")
        results = job.collect(timeout=60)
    finally:
        job.close()
    epoch, uuid, handles = _final_agree(results)
    assert len(handles) == 4 and uuid not in (before, shrunk)
    fenced = [e for e in results[3]["events"] if e[1] == "fenced"]
    assert len(fenced) == 1 and "was removed from the membership" in fenced[0][2]
    # Removal needs the heartbeat timeout (1 s), not much more.
    assert 0.5 < removed_after < 8, f"removed after {removed_after:.2f} s"
    # Every uuid ever used is distinct, and every rank saw the same chain from the rejoin on.
    uuids = [h[1] for r in results for h in results[r]["history"]]
    assert len(set(uuids)) == len({(h[0], h[1]) for r in results for h in results[r]["history"]})


def test_a_rendezvous_cut_short_by_the_callers_deadline_counts_no_one_as_a_no_show(coordinator: Any) -> None:
    """``sync(timeout=)`` shorter than the rendezvous timeout (the Manager passes what is left
    of its ``sync_timeout``): a member that had not arrived when it ran out proves nothing.
    Counted, two such calls removed a healthy member whose training thread was busy."""
    opts = {"expected": 2, "rendezvous_timeout": 10.0, "short": 0.4}
    job = harness.start(short_sync_worker, 3, tcp_spec(coordinator), opts)
    try:
        wait_states(job.store, [0, 1], lambda s: all("on" in v for v in s.values()), 60, "ranks 0 and 1 running")
        job.store.set("test/join2", "1")
        deadline = time.monotonic() + 60
        while int(job.store.add("test/short_done", 0)) < 2:
            assert time.monotonic() < deadline, "ranks 0 and 2 did not finish their short syncs"
            time.sleep(0.05)
        job.store.set("test/release1", "1")
        wait_states(job.store, [0, 1, 2], lambda s: all(v.get("done") for v in s.values()), 60,
                    "the three ranks on one configuration")
        job.store.set("test/stop", "1")
        res = job.collect(timeout=60)
    finally:
        job.close()
    for r in (0, 2):
        assert res[r]["short"].count("timeout") >= 2, res[r]  # rank 1 did not come: cut short each time
    finals = {tuple(res[r]["final"][:2]) for r in res}
    assert len(finals) == 1 and next(iter(finals))[1] == 3, res  # nobody removed
    assert all(res[r]["final"][2] == [3.0, 3.0] for r in res)

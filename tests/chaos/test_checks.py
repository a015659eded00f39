"""The chaos checks and schedules without processes: synthetic events that break each invariant
must be reported, good ones must not; schedules are deterministic and replay unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftc10d.chaos import checks
from ftc10d.chaos.runner import summarize
from ftc10d.chaos.schedule import Fault, ScheduleError, TrialSpec, draw, hosts_of, load_replay, trial_seeds
from ftc10d.chaos.trial import Injected, TrialResult


def ev(pid: int, kind: str, t: float, **kw: Any) -> dict[str, Any]:
    return {"pid": pid, "kind": kind, "t": t, **kw}


def good_run(steps: int = 5) -> list[dict[str, Any]]:
    out = []
    for pid in (1, 2, 3):
        out.append(ev(pid, "recovered", 0.0, step=0, fp="f0", member=f"m{pid}"))
        for s in range(1, steps + 1):
            out.append(ev(pid, "commit", s + pid / 100, step=s, fp=f"f{s}", member=f"m{pid}", epoch=1))
        out.append(ev(pid, "final", 99.0, step=steps, hash="h"))
    return out


def test_a_clean_run_has_no_problems() -> None:
    events = good_run()
    assert checks.check_commits(events, 5) == []
    assert checks.check_fencing(events, {1: ["m1", "m2", "m3"]}) == []


def test_differing_replicas_and_double_or_lost_steps_are_reported() -> None:
    events = good_run()
    events[3]["fp"] = "other"  # pid 1's step 3
    assert any("replicas differ after committed step 3" in p for p in checks.check_commits(events, 5))
    twice = good_run() + [ev(2, "commit", 50.0, step=5, fp="f5", member="m2", epoch=1)]
    assert any("applied twice" in p for p in checks.check_commits(twice, 5))
    skipped = [e for e in good_run() if not (e["pid"] == 3 and e.get("step") == 2 and e["kind"] == "commit")]
    assert any("skipped" in p for p in checks.check_commits(skipped, 5))
    back = good_run() + [ev(1, "recovered", 60.0, step=2, fp="f2")]
    assert any("was lost" in p for p in checks.check_commits(back, 5))
    short = [e for e in good_run() if e.get("step") != 5 or e["kind"] == "recovered"]
    assert any("never committed" in p for p in checks.check_commits(short, 5))


def test_a_step_rolled_back_is_not_a_divergence_but_a_divergence_event_is_one() -> None:
    """pid 1 applied step 5 alone in epoch 1 (another state: "x5"); the others redid it in epoch
    3; pid 1 then received their state (rolled back). States compare per (step, commit epoch)."""
    events = [e for e in good_run() if not (e["kind"] == "final")]
    for e in events:
        if e["kind"] == "commit":
            e["commit_epoch"] = 1 if e["step"] < 5 or e["pid"] == 1 else 3
    next(e for e in events if e["pid"] == 1 and e.get("step") == 5)["fp"] = "x5"
    events += [ev(1, "recovered", 60.0, step=5, fp="f5", epoch=3, rolled_back=[5, 1])]
    events += [ev(pid, "final", 99.0, step=5, hash="h") for pid in (1, 2, 3)]
    assert checks.check_commits(events, 5) == []
    # the same in one configuration is a divergence
    same = [dict(e, commit_epoch=1) if e["kind"] == "commit" else e for e in events]
    assert any("replicas differ after committed step 5 in epoch 1" in p for p in checks.check_commits(same, 5))
    diverged = events + [ev(2, "diverged", 70.0, step=5, ranks=[0], groups={"a": [0], "b": [1, 2]})]
    assert any("ReplicaDivergenceError at step 5" in p for p in checks.check_commits(diverged, 5))


def test_a_received_state_must_match_the_committed_one() -> None:
    events = good_run() + [ev(4, "recovered", 3.5, step=3, fp="bad", member="m4")]
    assert any("step 3" in p for p in checks.check_commits(events, 5))


def test_fenced_identity_that_commits_or_returns_is_reported() -> None:
    events = good_run()
    events.insert(3, ev(1, "fenced", 2.5, member="m1"))
    problems = checks.check_fencing(events, None)
    assert any("after that member was fenced" in p for p in problems)
    chain = {1: ["m1", "m2", "m3"], 2: ["m2", "m3"], 3: ["m1", "m2", "m3"]}
    assert any("is back at epoch 3" in p for p in checks.check_fencing(good_run(), chain))
    outsider = good_run() + [ev(9, "commit", 2.0, step=2, fp="f2", member="m9", epoch=1)]
    assert any("not in the configuration" in p for p in checks.check_fencing(outsider, {1: ["m1", "m2", "m3"]}))


def test_two_groups_training_apart_are_caught_even_when_they_compute_alike() -> None:
    """What a coordinator restart produced: members 1, 2 go on in epoch 2 while 3, 4 (same ids,
    never fenced) come back in epoch 7 and commit the same steps again, bitwise alike."""
    events = []
    for pid in (1, 2, 3, 4):
        events.append(ev(pid, "reconfigured", 0.0, epoch=1, uuid=11, member=f"m{pid}"))
        events += [ev(pid, "commit", s, step=s, fp=f"f{s}", member=f"m{pid}", uuid=11) for s in (1, 2, 3)]
    for pid, ep, uuid, t in ((1, 2, 22, 4.0), (2, 2, 22, 4.0), (3, 7, 77, 20.0), (4, 7, 77, 20.0)):
        events.append(ev(pid, "reconfigured", t, epoch=ep, uuid=uuid, member=f"m{pid}"))
        events += [ev(pid, "commit", t + s, step=s, fp=f"f{s}", member=f"m{pid}", uuid=uuid) for s in (4, 5, 6)]
    assert not [p for p in checks.check_commits(events, 6) if "differ" in p]  # every fingerprint agrees...
    assert any("two lineages" in p for p in checks.check_lineage(events))  # ...but the steps went back
    chain = {2: ["m1", "m2"], 3: ["m1", "m2"], 7: ["m3", "m4"]}  # epoch 1 was lost with the store
    assert any("never fenced" in p for p in checks.check_fencing(events, chain))
    assert checks.check_lineage([e for e in events if e["pid"] in (1, 2)]) == []


def test_stall_is_the_longest_gap_without_a_commit_after_the_fault() -> None:
    times = [(float(t), s) for s, t in enumerate([1, 2, 3, 3.2, 6.0, 6.1, 6.2], start=1)]
    assert checks.stall_after(times, 3.1, 3.1) == pytest.approx(0.1)   # window ends at the first commit
    assert checks.stall_after(times, 3.1, 3.5) == pytest.approx(2.8)   # 3.2 -> 6.0
    assert checks.stall_after(times, 6.15, 6.15) == pytest.approx(0.05)
    assert checks.stall_after(times, 7.0, 7.0) is None


def test_condense_keeps_a_few_of_each() -> None:
    out = checks.condense([f"replicas differ after committed step {i}" for i in range(10)] + ["other thing"])
    assert len(out) == 5 and out[-1].startswith("... and 7 more")


def test_schedules_are_deterministic_valid_and_replay_unchanged(tmp_path: Path) -> None:
    seeds = trial_seeds(42, 20)
    assert seeds == trial_seeds(42, 20) and len(set(seeds)) == 20
    kinds = set()
    for seed in seeds:
        spec = draw(seed)
        assert draw(seed) == spec
        kinds |= {f.kind for f in spec.faults}
        path = tmp_path / f"{seed}.json"
        path.write_text(json.dumps({"spec": spec.to_json(), "violations": []}))
        assert load_replay(str(path)) == spec
    assert {"kill", "stop_short", "stop_long", "slow", "double"} <= kinds
    assert "partition" not in kinds  # one host


def test_bad_replay_files_and_faults_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ScheduleError, match="cannot read"):
        load_replay(str(bad))
    for fault in ({"kind": "meteor", "slot": 0, "at_step": 10}, {"kind": "kill", "slot": 9, "at_step": 10},
                  {"kind": "kill", "slot": 0, "at_step": 999}, {"kind": "stop_long", "slot": 0, "at_step": 10},
                  {"kind": "partition", "slot": 1, "at_step": 10, "duration": 2.0}, {"kind": "kill", "x": 1}):
        with pytest.raises(ScheduleError):
            TrialSpec.from_json({"seed": 1, "faults": [fault]})


def test_hosts_keep_a_majority_on_the_coordinators_side() -> None:
    assert hosts_of(4, 1) == [0, 0, 0, 0]
    assert hosts_of(4, 2) == [0, 0, 0, 1]
    assert hosts_of(5, 3) == [0, 0, 0, 1, 2]
    with pytest.raises(ScheduleError):
        hosts_of(4, 3)


def test_summary_counts_kinds_stalls_and_violations() -> None:
    spec = TrialSpec(7, [Fault("kill", 1, 10), Fault("stop_short", 2, 30, 0.3)])
    ok = TrialResult(spec, [], [Injected(spec.faults[0], t_fault=1.0, stall_s=0.4),
                                Injected(spec.faults[1], skipped="ended")], 20.0, 0, folder="/x/trials/0-7")
    bad = TrialResult(spec, ["replicas differ"], [Injected(spec.faults[0], t_fault=1.0, stall_s=0.9)], 30.0, 0,
                      folder="/x/trials/1-7")
    s = summarize([ok, bad], "ftc10d chaos")
    assert s["trials"] == 2 and s["survived"] == 1
    assert s["faults_by_kind"] == {"kill": 2} and s["faults_skipped_by_kind"] == {"stop_short": 1}
    assert s["worst_stall_s_by_kind"] == {"kill": 0.9}
    assert s["violations"] == [{"seed": 7, "schedule": spec.describe(), "violations": ["replicas differ"],
                                "replay": "/x/trials/1-7.json"}]


def test_etcd_faults_are_drawn_only_with_etcd_membership_and_replay_unchanged(tmp_path: Path) -> None:
    etcd_kinds: set[str] = set()
    for seed in trial_seeds(42, 40):
        assert "etcd" not in {f.kind for f in draw(seed).faults}, "the default membership is the coordinator"
        spec = draw(seed, membership="etcd")
        assert spec.membership == "etcd" and draw(seed, membership="etcd") == spec
        kinds = {f.kind for f in spec.faults}
        assert "store" not in kinds, "store is the coordinator TCPStore's fault (membership tcp)"
        etcd_kinds |= kinds
        for f in spec.faults:
            if f.kind == "etcd":
                assert 0 <= f.slot < 3 and f.duration is not None and 0.5 <= f.duration <= 3.0
                assert str(f) == f"etcd@{f.at_step} etcd member {f.slot} for {f.duration:.2f} s"
        path = tmp_path / f"{seed}.json"
        path.write_text(json.dumps({"spec": spec.to_json(), "violations": []}))
        assert load_replay(str(path)) == spec
    assert "etcd" in etcd_kinds
    old = draw(7).to_json()
    del old["membership"]  # a record from before the option replays as a coordinator trial
    assert TrialSpec.from_json(old).membership == "tcp"


def test_bad_etcd_faults_are_refused() -> None:
    etcd = {"kind": "etcd", "slot": 0, "at_step": 10, "duration": 1.0}
    with pytest.raises(ScheduleError, match="--membership etcd"):
        TrialSpec.from_json({"seed": 1, "faults": [etcd]})
    for fault, words in (({**etcd, "slot": 3}, r"not in \[0, 3\)"), ({**etcd, "duration": None}, "positive duration")):
        with pytest.raises(ScheduleError, match=words):
            TrialSpec.from_json({"seed": 1, "membership": "etcd", "faults": [fault]})
    with pytest.raises(ScheduleError, match="--hosts 1"):
        TrialSpec.from_json({"seed": 1, "membership": "etcd", "hosts": 2, "faults": []})
    with pytest.raises(ScheduleError, match="membership 'zk'"):
        TrialSpec.from_json({"seed": 1, "membership": "zk", "faults": []})


def test_summary_counts_etcd_faults_by_kind() -> None:
    spec = TrialSpec(7, [Fault("etcd", 2, 10, 1.5), Fault("kill", 1, 40)], membership="etcd")
    r = TrialResult(spec, [], [Injected(spec.faults[0], t_fault=1.0, stall_s=0.3),
                               Injected(spec.faults[1], t_fault=5.0, stall_s=0.5)], 20.0, 0)
    s = summarize([r], "ftc10d chaos --membership etcd")
    assert s["faults_by_kind"] == {"etcd": 1, "kill": 1} and s["worst_stall_s_by_kind"] == {"etcd": 0.3, "kill": 0.5}


def test_guard_checks_without_a_stale_write_are_clean_and_counted() -> None:
    events = good_run() + [
        ev(1, "guard_abort", 3.1, step=3, uuids=["7"], snapshots=2, pending=2, raised=2, completed_at_cut=0,
           still_running=0),
        ev(1, "guard_check", 3.5, when="reconfigured", checked=2, changed=0),
        ev(1, "guard_check", 6.0, when="steps", checked=2, changed=0),
        ev(1, "guard_check", 99.5, when="exit", checked=2, changed=0),
    ]
    assert checks.check_guards(events) == []
    cov = checks.coverage(events)
    assert (cov["guard_snapshots"], cov["guard_waits_raised"], cov["guard_checks"]) == (2, 2, 6)


def test_a_guard_written_after_the_abort_returned_is_a_violation() -> None:
    events = good_run() + [
        ev(2, "guard_abort", 3.1, step=3, uuids=["7"], snapshots=1, pending=1, raised=1, completed_at_cut=0,
           still_running=0),
        ev(2, "guard_violation", 3.5, op="recv", step=3, uuid="7",
           error="its tensor changed after the abort of its configuration returned (checked reconfigured)"),
        ev(2, "guard_check", 3.5, when="reconfigured", checked=1, changed=1),
    ]
    problems = checks.check_guards(events)
    assert len(problems) == 1 and "pid 2" in problems[0] and "changed after the abort" in problems[0]
    assert "invariant 2" in problems[0]
    assert checks.coverage(events)["guard_checks"] == 1


def test_the_longest_pause_is_the_longest_gap_between_the_jobs_commits() -> None:
    times = checks.commit_times(good_run())  # pid 1 commits step s at s + 0.01: gaps of 1 s
    assert checks.longest_pause(times) == 1.0
    late = good_run() + [ev(2, "commit", 40.0, step=6, fp="f6", member="m2", epoch=2)]  # step 6 at 40 s
    assert checks.longest_pause(checks.commit_times(late)) == 35.0 - 0.01
    assert checks.longest_pause([]) is None
    assert checks.longest_pause_at(checks.commit_times(late)) == (5, 6)
    assert checks.longest_pause_at([]) == (-1, -1)


def test_the_pause_bound_is_two_detections_and_an_allowance_plus_a_store_outage() -> None:
    hb = 0.75
    plain = TrialSpec(1, [Fault("kill", 1, 20), Fault("stop_long", 2, 60, 2.0)], heartbeat_timeout=hb)
    assert checks.pause_bound(plain) == 2 * hb + checks.PAUSE_ALLOWANCE_S
    store = TrialSpec(1, [Fault("store", 0, 20, 1.2), Fault("kill", 1, 60)], heartbeat_timeout=hb)
    assert checks.pause_bound(store) == round(2 * hb + checks.PAUSE_ALLOWANCE_S + 1.2 + hb, 3)
    # The 30-s join stall of issue 14 and a 5-s store connect stall are both over it.
    assert checks.pause_bound(plain) < 5.0 and checks.pause_bound(store) < 30.0


def test_a_rollback_forced_by_the_death_of_every_holder_is_one_lineage_and_a_live_holder_is_not() -> None:
    """Chaos run of 2026-12-05, trial 75 (die_after_vote + die_send): in epoch 2 only pid 1
    committed step 4 (pid 2 failed the step), pid 1 died sending that state, and epoch 5
    went on from step 3 and committed step 4 again. Nobody alive held step 4: not a split."""
    events = [ev(pid, "reconfigured", 0.0, epoch=2, uuid=22, member=f"m{pid}") for pid in (1, 2)]
    events += [ev(pid, "commit", s, step=s, fp=f"f{s}", member=f"m{pid}", uuid=22) for pid in (1, 2) for s in (1, 2, 3)]
    events.append(ev(1, "commit", 4.0, step=4, fp="f4", member="m1", uuid=22))
    events.append(ev(1, "suicide", 4.5, op="send", step=4))
    events += [ev(pid, "reconfigured", 5.0, epoch=5, uuid=55, member=f"m{pid}") for pid in (2, 3)]
    events.append(ev(3, "recovered", 5.0, step=3, epoch=2, source=0))
    events += [ev(pid, "commit", 5.0 + s, step=s, fp=f"g{s}", member=f"m{pid}", uuid=55) for pid in (2, 3)
               for s in (4, 5)]
    assert checks.check_lineage(events) == []
    # The same commits with pid 1 alive (it only stopped): it still holds step 4, a second lineage.
    alive = [e for e in events if e["kind"] != "suicide"]
    assert any("two lineages" in p for p in checks.check_lineage(alive))
    # ...and pid 1 SIGKILLed by the schedule instead (no suicide event): one lineage again.
    assert checks.check_lineage(alive, deaths={1: 4.5}) == []
    # A replacement that had received step 4 alive before epoch 5 resumed from step 3: two lineages.
    got4 = alive + [ev(4, "recovered", 4.8, step=4, epoch=2, source=0)]
    assert any("two lineages" in p for p in checks.check_lineage(got4, deaths={1: 4.5}))


def test_listening_owners_names_the_process_holding_a_port() -> None:
    """A trial's coordinator port found listening after the trial is a leak only if a trial
    process (or the runner) holds it; a port another process took since is reported, not
    counted (a vote-weighted run once flagged a port that a test suite's store had taken)."""
    import os
    import socket

    from ftc10d.chaos.checks import listening_owners

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        owners = listening_owners(port)
        assert "python" in owners.get(os.getpid(), "")
    assert listening_owners(port) == {}


def test_mesh_schedules_never_take_every_holder_of_a_shard_and_replay_unchanged(tmp_path: Path) -> None:
    """``--mesh 2x2``: a double's two slots hold different shard indices, ``node`` names a
    replica, ``die_send`` (only other holder dies as it sends) and partitions are not drawn."""
    kinds: set[str] = set()
    for seed in trial_seeds(5, 60):
        spec = draw(seed, mesh=[2, 2])
        assert spec.mesh == [2, 2] and spec.world_size == 4 and draw(seed, mesh=[2, 2]) == spec
        for f in spec.faults:
            kinds.add(f.kind)
            assert f.kind not in ("die_send", "partition", "etcd"), spec
            if f.kind == "double":
                assert f.slot % 2 != f.slot2 % 2, spec  # type: ignore[operator]
            if f.kind == "node":
                assert 0 <= f.slot < 2 and str(f) == f"node@{f.at_step} replica {f.slot}"
        path = tmp_path / f"{seed}.json"
        path.write_text(json.dumps({"spec": spec.to_json()}))
        assert load_replay(str(path)) == spec
    assert {"node", "double", "kill", "die_vote"} <= kinds
    assert "node" not in {f.kind for s in trial_seeds(5, 60) for f in draw(s).faults}, "node is a mesh fault"
    assert "die_send" in {f.kind for s in trial_seeds(5, 60) for f in draw(s, mesh=[3, 2]).faults}


def test_bad_mesh_trials_are_refused() -> None:
    base = {"seed": 1, "world_size": 4, "mesh": [2, 2]}
    cases = [
        ({**base, "faults": [{"kind": "die_send", "slot": 0, "at_step": 10}]}, "only other holder"),
        ({**base, "faults": [{"kind": "double", "slot": 0, "slot2": 2, "kind2": "kill", "at_step": 10}]},
         "same shard index"),
        ({**base, "faults": [{"kind": "node", "slot": 2, "at_step": 10}]}, r"not in \[0, 2\)"),
        ({"seed": 1, "faults": [{"kind": "node", "slot": 0, "at_step": 10}]}, "--mesh RxS"),
        ({**base, "world_size": 6, "faults": []}, "not world_size=6"),
        ({**base, "world_size": 2, "mesh": [1, 2], "faults": []}, "at least 2 replicas"),
        ({**base, "hosts": 2, "faults": []}, "one host"),
        ({**base, "mesh": [2, 0], "faults": []}, "whole numbers >= 1"),
    ]
    for obj, words in cases:
        with pytest.raises(ScheduleError, match=words):
            TrialSpec.from_json(obj)


def test_mesh_states_compare_per_shard() -> None:
    """Ranks of different shard indices hold different states; holders of one shard must agree."""
    events = []
    for pid, shard in ((1, 0), (2, 1), (3, 0), (4, 1)):
        for s in (1, 2):
            events.append(ev(pid, "commit", s + pid / 100, step=s, fp=f"f{s}-{shard}", member=f"m{pid}",
                             commit_epoch=1, shard=shard))
        events.append(ev(pid, "final", 9.0, step=2, hash=f"h{shard}", shard=shard))
    assert checks.check_commits(events, 2) == []
    events[0]["fp"] = "other"  # pid 1 (shard 0), step 1
    assert any("step 1 in epoch 1, shard 0" in p for p in checks.check_commits(events, 2))
    events[0]["fp"] = "f1-0"
    events[-1]["hash"] = "x"  # pid 4's final state (shard 1)
    assert any("differ at the end (shard 1)" in p for p in checks.check_commits(events, 2))


def test_a_step_rolled_forward_counts_as_committed_and_is_compared() -> None:
    """FT-HSDP: a rank whose vote of step 3 failed while it completed elsewhere applies step 3
    at recovery (``rolled_forward``, commit epoch in ``epoch``): not a skipped step, and its
    state is compared with the others' step 3."""
    events = good_run()
    events = [e for e in events if not (e["pid"] == 2 and e["kind"] == "commit" and e["step"] == 3)]
    for e in events:
        if e["kind"] == "commit":
            e["commit_epoch"] = 1
    rolled = ev(2, "rolled_forward", 3.03, step=3, epoch=1, fp="f3")
    events.append(rolled)
    events.sort(key=lambda e: (e["pid"], e["t"]))  # each process's events in its own order
    assert checks.check_commits(events, 5) == []
    rolled["fp"] = "other"
    assert any("replicas differ after committed step 3 in epoch 1" in p for p in checks.check_commits(events, 5))


def test_a_step_committed_in_two_configurations_is_a_second_history_even_with_equal_states() -> None:
    """Invariant 8: the stale schedule on code that lets the frozen member become the source.
    Steps 4-6 committed in epoch 2 by pids 1, 2; both die; pid 3 (frozen at step 3, epoch 1)
    comes back and pids 3, 4 commit steps 4-6 again in epoch 4, computing alike (equal
    fingerprints). check_commits sees nothing wrong; check_one_history does."""
    events = [ev(pid, "commit", s, step=s, fp=f"f{s}", member=f"m{pid}", commit_epoch=1) for pid in (1, 2, 3)
              for s in (1, 2, 3)]
    events += [ev(pid, "commit", 3 + s, step=s, fp=f"f{s}", member=f"m{pid}", commit_epoch=2) for pid in (1, 2)
               for s in (4, 5, 6)]
    events += [ev(4, "recovered", 10.0, step=3, fp="f3", epoch=1)]
    events += [ev(pid, "commit", 10 + s, step=s, fp=f"f{s}", member=f"m{pid}", commit_epoch=4) for pid in (3, 4)
               for s in (4, 5, 6)]
    assert not [p for p in checks.check_commits(events, 6, complete=False) if "differ" in p]
    problems = checks.check_one_history(events)
    assert len(problems) == 3 and "step 4 was committed in 2 configurations" in problems[0], problems
    # The rollback of invariant 1: in epoch 2, pid 2 saw the vote of step 6 fail (aborted_step at step 5)
    # while pid 1 committed it; pid 1 died; step 6 redone in epoch 4 is not a second history.
    partial = [e for e in events if not (e["pid"] == 2 and e.get("step") == 6 and e.get("commit_epoch") == 2)]
    partial.append(ev(2, "aborted_step", 9.5, step=5, epoch=2))
    assert [p.split(" was")[0] for p in checks.check_one_history(partial)] == ["step 4", "step 5"]


def test_a_job_that_completes_after_losing_its_newest_state_is_a_violation() -> None:
    from ftc10d.launch import EXIT_STOP_JOB

    stopped = [ev(3, "state_lost_exit", 20.0, error="StateLostError: the job committed step 6 of epoch 2 ...")]
    assert checks.check_state_lost(stopped, EXIT_STOP_JOB, lost_at=10.0) == []
    assert any("trained on from an older state" in p for p in checks.check_state_lost([], 0, lost_at=10.0))
    assert any("no worker raised StateLostError" in p for p in checks.check_state_lost([], EXIT_STOP_JOB, 10.0))
    assert checks.check_commits([ev(1, "commit", 1.0, step=1, fp="a")], 100, complete=False) == []


def test_a_stale_fault_ends_the_schedule() -> None:
    for seed in range(40):
        spec = draw(seed, max_faults=3, weights={"stale": 5})
        kinds = [f.kind for f in spec.faults]
        assert "stale" not in kinds[:-1], kinds
        for f in spec.faults:
            assert f.kind != "stale" or (f.duration is not None and 0.2 <= f.duration <= 6.0), f
    mesh = draw(3, mesh=[2, 2], weights={"stale": 50})
    assert mesh.faults[-1].kind == "stale", mesh.faults

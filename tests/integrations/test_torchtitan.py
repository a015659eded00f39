"""torchtitan trains through rank and replica loss on ftc10d (issue 26): its own llama3 debug
model, data loader, AdamW, LR scheduler and metrics, under a real ``ftc10d launch``, 2 replicas
x 2 FSDP2 shards over Gloo, real SIGKILLs. Runs in ``make test-titan`` (torchtitan and triton in
their own virtualenv, ``.venvtitan``); elsewhere it skips, saying so."""

from __future__ import annotations

import collections
import os

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed: these tests run in `make test-titan`")
pytest.importorskip("triton", reason="torchtitan imports triton: these tests run in `make test-titan`")

from ftc10d.integrations.torchtitan.job import TitanJob  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from ftc10d.integrations.torchtitan.assets import build

    return build(str(tmp_path_factory.mktemp("titan-assets")))


def _check_history(job: TitanJob) -> dict:
    """Invariants over every rank's events: returns the committed steps' losses by step."""
    events = job.events()
    commits = [e for e in events if e["kind"] == "step" and e["ok"]]
    # no step committed in two configurations, and never twice by one process
    epochs = collections.defaultdict(set)
    for e in commits:
        epochs[e["step"]].add(e["epoch"])
    assert all(len(v) == 1 for v in epochs.values()), {s: v for s, v in epochs.items() if len(v) > 1}
    per_process = collections.Counter((e["slot"], e["restart"], e["step"]) for e in commits)
    assert max(per_process.values()) == 1, [k for k, v in per_process.items() if v > 1]
    # every holder of a shard agrees at every committed step
    fps = collections.defaultdict(set)
    for e in events:
        if e["kind"] == "fingerprint":
            fps[(e["step"], e["shard"])].add(e["fp"])
    assert fps, "no fingerprints recorded"
    assert all(len(v) == 1 for v in fps.values()), {k: v for k, v in fps.items() if len(v) > 1}
    finals = collections.defaultdict(set)
    for e in events:
        if e["kind"] == "final":
            finals[e["shard"]].add((e["step"], e["hash"]))
    assert finals and all(len(v) == 1 for v in finals.values()), finals
    assert set(epochs) == set(range(1, job.steps + 1)), sorted(set(range(1, job.steps + 1)) - set(epochs))
    losses = collections.defaultdict(list)
    for e in commits:
        losses[e["step"]].append(e["loss"])
    return losses


def test_trains_through_a_rank_then_a_whole_replica_killed(assets: tuple[str, str], tmp_path: object) -> None:
    """SIGKILL one rank of replica 0 at step >= 4; once its replacement committed, SIGKILL both
    ranks of replica 1. The job completes every step; each step is committed in one
    configuration; holders of a shard agree at every committed step; the replacements
    recovered live state; the loss goes down."""
    job = TitanJob(str(tmp_path), steps=24).start(assets)
    job.wait("step 4", lambda: job.committed() >= 4, 240)
    job.kill(1)
    job.wait("the replacement of slot 1 to commit", lambda: job.committed(slot=1, restart=1) > 0, 120)
    job.kill(2, 3)
    job.wait("the replacements of replica 1 to commit", lambda: min(job.committed(slot=s, restart=1)
                                                                    for s in (2, 3)) > 0, 240)
    assert job.finish(300) == 0, open(os.path.join(str(tmp_path), "launch.log")).read()[-3000:]
    losses = _check_history(job)
    events = job.events()
    recovered = {(e["slot"], e["restart"]) for e in events if e["kind"] == "recovered"}
    assert {(1, 1), (2, 1), (3, 1)} <= recovered, recovered
    first = sum(losses[1]) / len(losses[1])
    last = sum(losses[job.steps]) / len(losses[job.steps])
    assert last < first - 1.0, (first, last)


def test_state_lost_restarts_from_the_checkpoint(assets: tuple[str, str], tmp_path: object) -> None:
    """Both holders of shard 0 (slot 0 of replica 0, slot 2 of replica 1) SIGKILLed at once after
    the checkpoint of step 4: nobody holds shard 0, so after --ftc10d.sync-timeout every rank
    raises StateLostError (exit 86) and ``ftc10d launch --job-restarts 1`` starts the job again;
    torchtitan's trainer loads the newest checkpoint (written by one complete replica), the
    restored state equals the checkpoint's on every rank, and the job completes."""
    job = TitanJob(str(tmp_path), steps=10, launch_args=["--job-restarts", "1"],
                   extra=["--checkpoint.enable", "--checkpoint.interval", "4", "--ftc10d.sync-timeout", "6"])
    job.start(assets)
    job.wait("the checkpoint of step 4", lambda: any(e["kind"] == "checkpoint" and e["step"] == 4
                                                     for e in job.events()), 300)
    job.wait("step 5", lambda: job.committed() >= 5, 120)
    first_pids = {e["pid"] for e in job.events() if e["kind"] == "admitted"}
    job.kill(0, 2)
    assert job.finish(420) == 0, open(os.path.join(str(tmp_path), "launch.log")).read()[-3000:]
    log = open(os.path.join(str(tmp_path), "launch.log")).read()
    assert "starting it again from its checkpoint (1 of 1)" in log, log[-2000:]
    events = job.events()
    saved = {}
    for e in events:
        if e["kind"] == "checkpoint" and e["pid"] in first_pids:
            saved[(e["step"], e["shard"])] = e["fp"]
    assert {s for s, _ in saved} >= {4}, saved
    lost = [e for e in events if e["kind"] == "state_lost"]
    assert lost, "no rank reported state_lost"
    restored = [e for e in events if e["kind"] == "restored" and e["pid"] not in first_pids]
    assert len(restored) == 4, restored
    newest = max(s for s, _ in saved)
    for e in restored:
        assert e["step"] == newest and e["fp"] == saved[(newest, e["shard"])], (e, saved)
    second = [e for e in events if e["pid"] not in first_pids]
    steps = {e["step"] for e in second if e["kind"] == "step" and e["ok"]}
    assert steps == set(range(newest + 1, job.steps + 1)), sorted(steps)
    finals = collections.defaultdict(set)
    for e in second:
        if e["kind"] == "final":
            finals[e["shard"]].add(e["hash"])
    assert len(finals) == 2 and all(len(v) == 1 for v in finals.values()), finals

"""The launcher with real processes and real signals: exits, respawns, spares, shutdown,
and the report of an exit to the membership."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from ftc10d.launch import LaunchConfig, LaunchEvent, Launcher
from ftc10d.membership import Agreement, Coordinator, TCPMembershipStore
from ftc10d.membership.agreement import cfg_key
from ftc10d.membership.records import Signer
from ftc10d.membership.tcp import DEFAULT_PREFIX
from ftc10d.train.bootstrap import handle_key
from tests.launch.conftest import SCRIPTS, alive, child_env, records, wait_for

RECORD = str(SCRIPTS / "record_env.py")


def config(tmp_path: Path, *args: str, **kw: object) -> LaunchConfig:
    kw.setdefault("env", {"PYTHONPATH": child_env()["PYTHONPATH"]})
    return LaunchConfig(script=RECORD, script_args=[str(tmp_path), *args], **kw)  # type: ignore[arg-type]


def kinds(events: list[LaunchEvent]) -> list[str]:
    return [e.kind for e in events]


def test_trivial_script_exits_0_and_the_launcher_returns_0(tmp_path: Path) -> None:
    with Launcher(config(tmp_path, "--exit", "0", nproc_per_node=2)) as launcher:
        assert launcher.wait(60) == 0
        events = launcher.events
    recs = records(tmp_path)
    assert sorted(r["env"]["RANK"] for r in recs.values()) == ["0", "1"]
    assert {r["env"]["FTC10D_LAUNCH_ID"] for r in recs.values()} == {launcher.launch_id}
    assert kinds(events).count("exited") == 2 and events[-1].kind == "finished"
    assert events[-1].detail == {"returncode": 0}


def test_a_killed_worker_is_respawned_alone_in_its_slot(tmp_path: Path) -> None:
    with Launcher(config(tmp_path, "--sleep", nproc_per_node=3, max_restarts=2)) as launcher:
        wait_for(lambda: len(records(tmp_path)) == 3, 30, "3 workers")
        before = launcher.pids()
        victim = launcher.kill(1)
        assert victim == before[1]
        wait_for(lambda: len(records(tmp_path)) == 4, 30, "the replacement")
        after = launcher.pids()
        assert after[0] == before[0] and after[2] == before[2], "survivors must not be touched"
        assert after[1] != victim
        rec = records(tmp_path)[after[1]]
        assert rec["env"]["RANK"] == "1" and rec["env"]["LOCAL_RANK"] == "1"
        assert rec["env"]["FTC10D_RESTART_COUNT"] == "1" and rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert rec["preloaded"] is False  # no spares: a cold start
        exited = [e for e in launcher.events if e.kind == "exited"]
        assert exited[0].slot == 1 and exited[0].pid == victim and exited[0].detail["signal"] == "SIGKILL"
        respawned = [e for e in launcher.events if e.kind == "respawned"]
        assert [(e.slot, e.detail) for e in respawned] == [(1, {"warm": False, "restart": 1})]
    assert not any(alive(p) for p in list(after.values()) + [victim])


def test_max_restarts_exhausted_fails_the_job(tmp_path: Path) -> None:
    with Launcher(config(tmp_path, "--exit", "3", nproc_per_node=1, max_restarts=2)) as launcher:
        assert launcher.wait(60) != 0
        events = launcher.events
    assert kinds(events).count("respawned") == 2
    assert kinds(events).count("gave_up") == 1
    assert len(records(tmp_path)) == 3


def test_a_slot_that_gives_up_stops_the_job(tmp_path: Path) -> None:
    """As torchrun: slot 1 exits 1 every time and has 1 restart, slot 0 would sleep for ever.
    Once slot 1 gave up, ``ftc10d launch`` stops slot 0 and exits 1, naming the slot and its last exit."""
    cmd = [sys.executable, "-m", "ftc10d", "-v", "launch", "--nproc-per-node", "2", "--max-restarts", "1",
           RECORD, str(tmp_path), "--sleep", "--exit", "1", "--exit-rank", "1"]
    proc = subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        raise AssertionError(f"the launcher still runs 60 s after its start; stderr: {proc.communicate()[1]}")
    # every worker the launcher started, from its event lines ("started slot 0 pid 123 ...")
    workers = {int(ln.split(" pid ")[1].split()[0]): ln for ln in err.splitlines()
               if ln.startswith(("ftc10d launch: started", "ftc10d launch: respawned"))}
    assert proc.returncode == 1, err
    assert len(workers) == 3, err  # slot 0, and slot 1 twice
    assert not [pid for pid in workers if alive(pid)], f"workers left running; stderr: {err}"
    assert "slot 1 gave up: its worker" in err and "(exit code 1)" in err, err
    assert [ln for ln in err.splitlines() if "gave_up slot 1" in ln and "returncode=1" in ln], err


@pytest.mark.parametrize("backend", ["ftc10d", "gloo"])
def test_a_plain_init_process_group_script_runs_under_ftc10d_launch(tmp_path: Path, backend: str) -> None:
    """``dist.init_process_group(backend)`` with the default env://: every rank connects to the
    launcher's store (MASTER_PORT) as a client, as under torchrun; rank 0 used to try to host a
    store on that port (EADDRINUSE) while the others waited 300 s for it."""
    cmd = [sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "2", "--max-restarts", "0",
           "--log-dir", str(tmp_path), str(SCRIPTS / "plain_init.py"), backend]
    run = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=60)
    logs = "".join(f"== {p.name}\n{p.read_text()}" for p in sorted(tmp_path.iterdir()))
    assert run.returncode == 0, run.stderr + logs
    for slot in (0, 1):
        out = (tmp_path / f"worker{slot}.0.out").read_text()
        assert out == f"plain_init: rank {slot} of 2: all_reduce 3.0 ok\n", logs


def test_warm_spare_is_promoted_and_replaced(tmp_path: Path) -> None:
    with Launcher(config(tmp_path, "--sleep", nproc_per_node=2, spares=1)) as launcher:
        wait_for(lambda: len(records(tmp_path)) == 2, 30, "2 workers")
        wait_for(lambda: "spare_ready" in kinds(launcher.events), 60, "the spare to be ready")
        spare = launcher.spare_pids()[0]
        launcher.kill(0)
        wait_for(lambda: len(records(tmp_path)) == 3, 30, "the replacement")
        assert launcher.pids()[0] == spare, "the spare became slot 0's worker"
        rec = records(tmp_path)[spare]
        assert rec["preloaded"] is True, "a promoted spare has torch imported before the script starts"
        assert rec["env"]["RANK"] == "0" and rec["env"]["FTC10D_RESTART_COUNT"] == "1"
        assert rec["argv"] == [str(tmp_path), "--sleep"]
        respawned = [e for e in launcher.events if e.kind == "respawned"]
        assert respawned[0].detail == {"warm": True, "restart": 1} and respawned[0].pid == spare
        new = wait_for(lambda: [p for p in launcher.spare_pids() if p != spare], 10, "a new spare")
        assert alive(new[0])
        # the new spare has not started the script: still exactly 3 records
        assert len(records(tmp_path)) == 3
        os.kill(new[0], signal.SIGKILL)  # a spare that dies is replaced
        again = wait_for(lambda: [p for p in launcher.spare_pids() if p not in (spare, new[0])], 10,
                         "a spare replacing the dead one")
        assert launcher.pids()[0] == spare and len(records(tmp_path)) == 3
    assert not alive(new[0]) and not alive(spare) and not alive(again[0])


def test_sigterm_to_ftc10d_launch_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "2", "--spares", "1",
                             RECORD, str(tmp_path), "--sleep"], env=child_env(), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        wait_for(lambda: len(records(tmp_path)) == 2, 60, "2 workers")
        ready = wait_for(lambda: [ln for ln in lines if "spare_ready" in ln], 60, "the spare")
        spare = int(ready[0].split(" pid ")[1].split()[0])
        workers = list(records(tmp_path))
        assert all(alive(p) for p in workers + [spare])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        reader.join(5)
        assert not [p for p in workers + [spare] if alive(p)], "orphans left behind"
        assert any("the job failed" in ln for ln in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_of_the_launcher_takes_its_children_along(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "2", RECORD,
                             str(tmp_path), "--sleep"], env=child_env(), stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(records(tmp_path)) == 2, 60, "2 workers")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not any(alive(p) for p in records(tmp_path)), 10, "the workers to die with the launcher")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("external", [False, True], ids=["embedded", "external-signed"])
def test_the_exit_is_reported_to_the_membership(tmp_path: Path, external: bool) -> None:
    """Two idle members and a heartbeat timeout far away: neither a failed collective nor
    the detector (a suspicion needs a majority: 1 of 2 is not) can remove the dead one;
    only the launcher's confirmed report can. ``external``: the coordinator is not the
    launcher's (``--coordinator``) and the job has a token, so the report is a signed record."""
    token = "s3cret" if external else None
    coordinator = Coordinator(token=token, detect=False).start() if external else None
    cfg = LaunchConfig(script=str(SCRIPTS / "member_idle.py"), nproc_per_node=2, max_restarts=0,
                       heartbeat_timeout=30.0, env={"PYTHONPATH": child_env()["PYTHONPATH"]}, token=token,
                       coordinator=coordinator.address if coordinator is not None else None)
    try:
        with Launcher(cfg) as launcher:
            host, _, port = launcher.coordinator_address.rpartition(":")
            agreement = Agreement(TCPMembershipStore(host, int(port)), Signer(token))
            first = wait_for(lambda: (c := agreement.latest()) is not None and c.size == 2 and c, 60,
                             "the first configuration of 2")
            victim = launcher.pids()[1]
            store = TCPStore(host, int(port), is_master=False)
            handle = store.get(handle_key(launcher.launch_id, victim)).decode()
            assert handle in first.handles
            launcher.kill(1)
            after = wait_for(lambda: (c := agreement.latest()) is not None and c.epoch > first.epoch and c, 20,
                             "a configuration without the dead worker")
            assert handle not in after.handles and after.size == 1
            reported = wait_for(lambda: [e for e in launcher.events if e.kind == "reported"], 10, "the reported event")
            assert reported[0].pid == victim and reported[0].detail["epoch"] == after.epoch
            assert "gave_up" in kinds(launcher.events)
            raw = json.loads(store.get(DEFAULT_PREFIX + cfg_key(after.epoch)))
            assert ("s" in raw) == external, "the launcher's record is signed with the job token"
    finally:
        if coordinator is not None:
            coordinator.close()


def test_a_worker_exiting_with_exit_stop_job_stops_the_job_instead_of_being_respawned(tmp_path: Path) -> None:
    """EXIT_STOP_JOB (what a worker does on ReplicaDivergenceError): no respawn, the others are
    stopped, the launcher exits with that code."""
    from ftc10d.launch import EXIT_STOP_JOB

    cfg = config(tmp_path, "--sleep", "--exit", str(EXIT_STOP_JOB), "--exit-rank", "1", nproc_per_node=3,
                 max_restarts=3, spares=1)
    with Launcher(cfg) as launcher:
        assert launcher.wait(60) == EXIT_STOP_JOB
        events = launcher.events
    assert "respawned" not in kinds(events), kinds(events)
    gave_up = [e for e in events if e.kind == "gave_up"]
    assert gave_up and gave_up[0].slot == 1 and gave_up[0].detail.get("stop_job") is True
    assert not [pid for pid in records(tmp_path) if alive(pid)], "the other workers must be stopped"


@pytest.mark.parametrize("kind,code", [("StateLostError", 86), ("ReplicaDivergenceError", 86), ("RuntimeError", 1)])
def test_an_uncaught_state_loss_stops_the_job_instead_of_respawning(tmp_path: Path, kind: str, code: int) -> None:
    """A worker whose Manager raised StateLostError (nobody holds the job's newest state) or
    ReplicaDivergenceError and did not catch it exits EXIT_STOP_JOB (``init_from_env``'s hook):
    the launcher stops the job at once instead of respawning it into the same loss (each respawn
    would wait sync_timeout for a holder that is gone). Other errors keep exit code 1 and the respawns."""
    cmd = [sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "2", "--max-restarts", "1",
           "--log-dir", str(tmp_path), str(SCRIPTS / "lose_state.py"), kind]
    run = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=120)
    logs = "".join(f"== {p.name}\n{p.read_text()}" for p in sorted(tmp_path.iterdir()))
    assert run.returncode == code, run.stderr + logs
    assert f"{kind}: test:" in logs, logs  # the traceback, printed as python does
    restarted = (tmp_path / "worker1.1.err").exists()
    assert restarted == (code == 1), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("restarts,launches,code", [(1, 2, 0), (0, 2, 86), (2, 5, 86)])
def test_job_restarts_start_a_job_that_stopped_itself_again(tmp_path: Path, restarts: int, launches: int,
                                                            code: int) -> None:
    """``ftc10d launch --job-restarts K``: a job whose worker exits EXIT_STOP_JOB (86) is started
    again as a new job (new launch id, every worker fresh), at most K times; the launcher's exit
    code is the last job's."""
    script = str(SCRIPTS / "stop_job_until.py")
    proc = subprocess.run([sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "2", "--job-restarts",
                           str(restarts), script, str(tmp_path), str(launches)], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    written = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # a killed worker's .tmp may stay
    jobs = {p.name.split(".")[0] for p in written}
    assert len(jobs) == min(restarts + 1, launches), (jobs, proc.stderr[-2000:])
    assert {p.read_text() for p in written} == {"0"}  # fresh workers, not respawns
    assert proc.stderr.count("starting it again from its checkpoint") == len(jobs) - 1


def test_a_job_stop_on_one_node_stops_every_node(tmp_path: Path) -> None:
    """A worker exits EXIT_STOP_JOB (StateLostError) on node 1 of 2: node 1's launcher stops and
    tells the job; node 0's launcher stops its own workers and exits EXIT_STOP_JOB too (found by
    ``ftc10d chaos --hosts 2``: node 0's workers waited forever for members that were gone)."""
    from ftc10d.launch import EXIT_STOP_JOB

    env = {"PYTHONPATH": child_env()["PYTHONPATH"]}
    args = [str(tmp_path), "--sleep", "--exit", str(EXIT_STOP_JOB), "--exit-rank", "2"]
    coordinator = Coordinator().start()  # the job's, as `ftc10d coordinator` runs it
    node0 = Launcher(LaunchConfig(script=RECORD, script_args=args, nnodes=2, node_rank=0, nproc_per_node=2,
                                  max_restarts=3, env=env, coordinator=coordinator.address)).start()
    try:
        wait_for(lambda: len(records(tmp_path)) == 2, 60, "node 0's 2 workers")
        node0_pids = list(records(tmp_path))
        assert node0.returncode is None, "node 0 must run while node 1 has not stopped the job"
        with Launcher(LaunchConfig(script=RECORD, script_args=args, nnodes=2, node_rank=1, nproc_per_node=2,
                                   max_restarts=3, env=env, coordinator=node0.coordinator_address)) as node1:
            assert node1.wait(60) == EXIT_STOP_JOB
            assert node0.wait(30) == EXIT_STOP_JOB
            stopped = [e for e in node0.events if e.kind == "job_stopped"]
            assert stopped and stopped[0].detail["node_rank"] == 1, kinds(node0.events)
            assert "gave_up" not in kinds(node0.events) and "respawned" not in kinds(node0.events)
        assert not [pid for pid in node0_pids if alive(pid)], "node 0's workers must be stopped"
    finally:
        node0.close()
        coordinator.close()


def test_an_earlier_runs_job_stop_record_does_not_stop_a_new_run(tmp_path: Path) -> None:
    """A coordinator that outlives a job (``ftc10d coordinator``) still holds the job/stop record
    of the run that stopped; the run started after it (``--job-restarts``) must not take it for
    its own stop."""
    from ftc10d.launch.supervisor import JOB_STOP_KEY

    coordinator = Coordinator().start()
    try:
        host, _, port = coordinator.address.rpartition(":")
        store = TCPMembershipStore(host, int(port))
        store.put(JOB_STOP_KEY, Signer(None).encode(JOB_STOP_KEY, {"code": 86, "launcher": "earlier", "node_rank": 1}))
        store.close()
        cfg = config(tmp_path, "--sleep-s", "3", "--exit", "0", nproc_per_node=2, coordinator=coordinator.address)
        with Launcher(cfg) as launcher:
            assert launcher.wait(60) == 0, kinds(launcher.events)
            assert "job_stopped" not in kinds(launcher.events)
    finally:
        coordinator.close()

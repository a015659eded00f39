"""``ftc10d demo``: launch the workers, inject the fault schedule, watch, report.

The driver is the only process that sees everything: it tails the workers'
event files (``events/*.jsonl``), records what it injects (``faults.jsonl``) and
what the launcher did (``launcher.jsonl``), feeds the live view, and at the end
builds ``report.json``, ``timeline.png`` and the summary table.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ftc10d.demo.faults import Fault

WORKER = str(Path(__file__).with_name("worker.py"))


@dataclass
class DemoConfig:
    out: Path
    world_size: int = 4
    steps: int = 300
    faults: list[Fault] = field(default_factory=list)
    heartbeat_timeout: float = 1.0
    spares: int = 1
    fp_every: int = 10
    timeout: float = 180.0
    lr: float = 1e-3
    extra_args: list[str] = field(default_factory=list)  # more worker.py arguments (bench)
    #: Bound of the job's longest pause between two commits (None: heartbeat timeout + 1 s).
    max_pause: Optional[float] = None
    #: FT-HSDP: (replicas, ranks per replica); world_size must be their product.
    mesh: Optional[tuple[int, int]] = None

    @property
    def pause_bound(self) -> float:
        return self.max_pause if self.max_pause is not None else self.heartbeat_timeout + 1.0


class Tail:
    """New complete lines of every ``*.jsonl`` in a folder since the last poll."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._pos: dict[Path, int] = {}
        self._buf: dict[Path, bytes] = {}

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.folder.is_dir():
            return out
        for f in sorted(self.folder.glob("*.jsonl")):
            try:
                with open(f, "rb") as fh:
                    fh.seek(self._pos.get(f, 0))
                    data = fh.read()
            except FileNotFoundError:
                continue
            self._pos[f] = self._pos.get(f, 0) + len(data)
            data = self._buf.pop(f, b"") + data
            *lines, rest = data.split(b"\n")
            if rest:
                self._buf[f] = rest
            for line in lines:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        out.sort(key=lambda e: e["t"])
        return out


@dataclass
class Worker:
    slot: int
    pid: int
    status: str = "starting"
    rank: Optional[int] = None
    step: int = 0
    loss: Optional[float] = None
    epoch: int = 0
    world: int = 0
    aborted: int = 0
    last_t: float = 0.0


class JobState:
    """What the live view shows, updated from worker and launcher events."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.t0 = time.time()
        self.workers: dict[int, Worker] = {}
        self.step = 0
        self.loss: Optional[float] = None
        self.members = 0
        self.epoch = 0
        self.last_commit = self.t0
        self.longest_stall = 0.0
        self.log: deque[tuple[float, str]] = deque(maxlen=12)
        self.new_log: list[tuple[float, str]] = []
        self.injected: list[dict[str, Any]] = []

    def note(self, t: float, text: str) -> None:
        self.log.append((t - self.t0, text))
        self.new_log.append((t - self.t0, text))

    def worker(self, e: dict[str, Any]) -> Worker:
        w = self.workers.get(e["pid"])
        if w is None:
            w = self.workers[e["pid"]] = Worker(e.get("slot", -1), e["pid"])
        return w

    def apply(self, e: dict[str, Any]) -> None:
        w, kind, t = self.worker(e), e["kind"], e["t"]
        w.last_t = t
        if kind == "admitted":
            w.status, w.rank, w.world, w.epoch = "training", e["rank"], e["world_size"], e["epoch"]
            self.note(t, f"slot {w.slot} (pid {w.pid}) admitted as rank {e['rank']} of {e['world_size']}")
        elif kind == "step":
            w.rank, w.world, w.epoch = e["rank"], e["world_size"], e["epoch"]
            if w.status not in ("frozen", "killed"):
                w.status = "training"
            if e["ok"]:
                w.step, w.loss = e["step"], e["loss"]
                if e["step"] > self.step:
                    self.longest_stall = max(self.longest_stall, t - self.last_commit) if self.step > 5 else 0.0
                    self.step, self.loss, self.last_commit = e["step"], e["loss"], t
                    self.members, self.epoch = e["world_size"], e["epoch"]
                    if self.step % 25 == 0:
                        self.note(t, f"step {self.step}: loss {self.loss:.4g}, {self.members} members")
            else:
                w.aborted += 1
        elif kind == "aborted_step":
            self.note(t, f"slot {w.slot}: step {e.get('step')} not committed ({str(e.get('error'))[:60]})")
        elif kind == "reconfigured":
            self.note(t, f"slot {w.slot}: reconfigured to epoch {e.get('epoch')}, rank {e.get('rank')} of "
                         f"{e.get('world_size')} ({float(e.get('seconds', 0)) * 1000:.0f} ms)")
        elif kind == "recovered":
            w.status = "training"
            self.note(t, f"slot {w.slot}: received state of step {e.get('step')} from rank {e.get('source')} "
                         f"({int(e.get('bytes', 0)) / 1e6:.1f} MB)")
        elif kind == "fenced":
            w.status = "rejoining"
            self.note(t, f"slot {w.slot} (pid {w.pid}) resumed and found itself fenced: rejoining")
        elif kind == "left":
            w.status = "done"
            self.note(t, f"slot {w.slot} (pid {w.pid}) left: the job finished while it was out of it")
        elif kind == "final":
            w.status = "done"
        elif kind == "exit":
            w.status = "exited"

    def apply_launch(self, ev: Any) -> None:
        if ev.kind == "exited" and ev.pid in self.workers:
            w = self.workers[ev.pid]
            if w.status != "exited":
                w.status = "killed" if ev.detail.get("signal") else "exited"
            if ev.detail.get("returncode"):
                self.note(ev.time, f"slot {ev.slot} (pid {ev.pid}) exited: {ev.detail.get('signal') or ev.detail}")
        elif ev.kind == "respawned":
            how = "warm spare" if ev.detail.get("warm") else "cold start"
            self.note(ev.time, f"slot {ev.slot}: replacement pid {ev.pid} from a {how}")
        elif ev.kind == "gave_up":
            self.note(ev.time, f"slot {ev.slot}: launcher gave up")

    def stall_now(self) -> float:
        return time.time() - self.last_commit


def _event_dict(ev: Any) -> dict[str, Any]:
    return {"kind": ev.kind, "slot": ev.slot, "pid": ev.pid, "time": ev.time, "detail": dict(ev.detail)}


def _resume(rec: dict[str, Any], fault_log: Any) -> None:
    """SIGCONT a frozen worker and log the freeze (with its resume time) to faults.jsonl."""
    try:
        os.kill(rec["pid"], signal.SIGCONT)
    except ProcessLookupError:
        pass
    rec["t_resumed"] = time.time()
    fault_log.write(json.dumps(rec) + "\n")


def run_demo(cfg: DemoConfig, view: Any, *, quiet: bool = False) -> tuple[int, dict[str, Any]]:
    """Run the job; returns ``(exit code, report)``. ``view`` has ``start/update/stop/summary``."""
    from ftc10d.demo.report import build_report, write_report
    from ftc10d.launch import LaunchConfig, Launcher

    out = Path(cfg.out)
    for stale in ("events", "logs"):
        shutil.rmtree(out / stale, ignore_errors=True)
    for stale in ("faults.jsonl", "launcher.jsonl", "report.json", "timeline.png"):
        (out / stale).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "events").mkdir()

    state = JobState(cfg)
    events: "queue.Queue[Any]" = queue.Queue()
    src = str(Path(__file__).resolve().parents[2])
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    lc = LaunchConfig(
        script=WORKER,
        script_args=["--out", str(out), "--steps", str(cfg.steps), "--fp-every", str(cfg.fp_every),
                     "--lr", str(cfg.lr), *(["--mesh", f"{cfg.mesh[0]}x{cfg.mesh[1]}"] if cfg.mesh else []),
                     *cfg.extra_args],
        nproc_per_node=cfg.world_size, spares=cfg.spares, max_restarts=max(3, len(cfg.faults) + 1),
        heartbeat_timeout=cfg.heartbeat_timeout, env=env, log_dir=str(out / "logs"),
    )
    lc.validate()
    tail = Tail(out / "events")
    pending = list(cfg.faults)
    resume: list[tuple[float, int, dict[str, Any]]] = []
    rc: Optional[int] = None
    launch_log = open(out / "launcher.jsonl", "a", buffering=1)
    fault_log = open(out / "faults.jsonl", "a", buffering=1)
    launcher = Launcher(lc, on_event=events.put)
    view.start(state)
    try:
        launcher.start()
        state.note(time.time(), f"launched {cfg.world_size} workers + {cfg.spares} warm spare(s) "
                                f"(coordinator {launcher.coordinator_address})")
        deadline = time.monotonic() + cfg.timeout
        while rc is None:
            for e in tail.poll():
                state.apply(e)
            while True:
                try:
                    ev = events.get_nowait()
                except queue.Empty:
                    break
                launch_log.write(json.dumps(_event_dict(ev), default=str) + "\n")
                state.apply_launch(ev)
            now = time.time()
            for item in [r for r in resume if r[0] <= now]:
                resume.remove(item)
                _resume(item[2], fault_log)
                state.note(item[2]["t_resumed"], f"SIGCONT slot {item[2]['slot']} (pid {item[1]}) "
                                                 f"after {item[2]['duration']:g} s")
            while pending and state.step >= pending[0].at_step:
                f = pending[0]
                if f.slot not in launcher.pids():
                    break  # its worker is being replaced: try again on the next tick
                pending.pop(0)
                sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
                t = time.time()
                pid = launcher.kill(f.slot, sig)
                rec = {"kind": f.kind, "slot": f.slot, "pid": pid, "at_step": state.step, "t_fault": t,
                       "duration": f.duration}
                for w in state.workers.values():
                    if w.pid == pid:
                        w.status = "killed" if f.kind == "kill" else "frozen"
                state.injected.append(rec)
                if f.kind == "kill":
                    fault_log.write(json.dumps(rec) + "\n")
                    state.note(t, f"SIGKILL slot {f.slot} (pid {pid}) at step {state.step}")
                else:
                    resume.append((t + (f.duration or 0.0), pid, rec))
                    state.note(t, f"SIGSTOP slot {f.slot} (pid {pid}) at step {state.step} for {f.duration:g} s")
            view.update(state)
            if time.monotonic() > deadline:
                state.note(time.time(), f"timed out after {cfg.timeout:g} s")
                rc = 124
                break
            try:
                rc = launcher.wait(timeout=0.05)
            except TimeoutError:
                continue
        for e in tail.poll():
            state.apply(e)
        view.update(state)
    finally:
        for _, _, rec in resume:  # never leave a stopped process behind
            _resume(rec, fault_log)
        launcher.close()
        while True:
            try:
                launch_log.write(json.dumps(_event_dict(events.get_nowait()), default=str) + "\n")
            except queue.Empty:
                break
        launch_log.close()
        fault_log.close()
        view.stop()
    report = build_report(out, world_size=cfg.world_size, steps=cfg.steps, heartbeat_timeout=cfg.heartbeat_timeout,
                          launcher_returncode=rc,
                          extra={"schedule": [str(f) for f in cfg.faults], "spares": cfg.spares})
    report["faults_injected"] = len(state.injected)
    report["all_recovered"] = all(f["recovered"] for f in report["faults"])
    report["longest_pause_bound_s"] = cfg.pause_bound
    report["longest_pause_ok"] = report["longest_pause_s"] is not None and report["longest_pause_s"] <= cfg.pause_bound
    write_report(report, out)
    try:
        from ftc10d.demo.plot import plot_timeline

        plot_timeline(out, report)
    except ImportError as exc:  # matplotlib is the `demo` extra
        report["plot_error"] = f"no timeline.png: {exc} (pip install 'ftc10d[demo]')"
        write_report(report, out)
    # A demo that says "yes" after a long pause would be lying to its user: the pause is part of the verdict.
    ok = rc == 0 and report["completed"] and report["replicas_identical"] and report["longest_pause_ok"]
    return (0 if ok else 1), report


def main(*, out: str, world_size: int, steps: int, faults: Optional[str], heartbeat_timeout: float, live: bool,
         spares: int = 1, timeout: float = 180.0, max_pause: Optional[float] = None,
         mesh: Optional[tuple[int, int]] = None) -> int:
    """``ftc10d demo``: parse the schedule (raises FaultScheduleError), run, print the summary."""
    from ftc10d.demo.faults import parse_schedule
    from ftc10d.demo.live import LiveView, PlainView, print_summary

    schedule = parse_schedule(faults, world_size=world_size, steps=steps)
    cfg = DemoConfig(Path(out), world_size=world_size, steps=steps, faults=schedule,
                     heartbeat_timeout=heartbeat_timeout, spares=spares, timeout=timeout, max_pause=max_pause,
                     mesh=mesh)
    use_rich = live
    if live:
        try:
            view: Any = LiveView()
        except ImportError:
            print("ftc10d demo: rich is not installed (pip install 'ftc10d[demo]'); plain output", flush=True)
            view, use_rich = PlainView(), False
    else:
        view = PlainView()
    what = f"FT-HSDP {mesh[0]}x{mesh[1]} (FSDP2 inside each replica), " if mesh else ""
    print(f"ftc10d demo: {what}{world_size} workers + {spares} warm spare(s), {steps} steps, faults "
          f"{', '.join(map(str, schedule)) or 'none'}, heartbeat timeout {heartbeat_timeout:g} s, out {out}",
          flush=True)
    code, report = run_demo(cfg, view)
    print_summary(report, str(out), rich_output=use_rich)
    return code

"""Kill one rank of a running job and watch the others carry on, in place.

This is what ``ftc10d demo`` runs until the full training demo exists. The
calling process plays the launcher: it hosts the ``TCPStore`` (so killing any
rank never takes the rendezvous down), starts ``world_size`` worker processes,
and, once every rank has done ``steps`` correct allreduces, SIGKILLs one of them.
Each survivor then

1. sees a typed :class:`ftc10d.PeerFailureError` naming the dead rank in
   ``.peer`` (even when what it saw break was its connection to a survivor
   that aborted first: the first member to name the dead rank records it in
   the store). Its pending allreduce fails within milliseconds instead of
   hanging until the timeout, and the generation is aborted (the abort hook
   fires),
2. agrees with the other survivors on the new member list through the store
   (each writes its reconfigure handle under a key of the next uuid and waits
   for the others'; the demo knows which rank it killed, real membership
   agreement is a later layer),
3. calls :func:`ftc10d.reconfigure` with that fresh uuid, and
4. carries on allreducing ``steps`` more times in the smaller group, checking
   every result.

Workers report what they see as events over one pipe each (not a shared
``multiprocessing.Queue``: a SIGKILLed process can die holding a queue's
cross-process lock and wedge every other writer). Event times are
``time.monotonic()``, which on Linux is ``CLOCK_MONOTONIC``, one clock for every
process on the host, so times taken in different processes compare directly.

Run it with ``ftc10d demo`` or ``python -m ftc10d.examples.reconfigure_after_kill``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, Callable, Optional, TextIO

import torch
import torch.distributed as dist

import ftc10d

#: Elements of each allreduce (256 KiB of float32): big enough that Gloo really
#: streams it through its ring, small enough for a 2-core machine.
NUMEL = 1 << 16
#: Store keys of the demo itself; ftc10d's own keys live under ``ftc10d/``.
KEY_ROOT = "demo"
CLI = -1  # the "rank" of events recorded by the calling process

Emit = Callable[..., None]


@dataclass(frozen=True)
class DemoConfig:
    """What to run. The defaults finish in a few seconds on two cores."""

    world_size: int = 4
    kill_rank: int = 2
    steps: int = 20
    #: Pause between steps, like the compute of a training step. It leaves the
    #: CPUs to the other ranks and gives the kill a realistic moment to land.
    interval_s: float = 0.02
    #: Bounds everything: op and rendezvous timeout, and the whole run.
    timeout_s: float = 60.0
    #: The uuid of the configuration after the failure. The store is new for
    #: every run, so any uuid is fresh; a long-lived job would draw a new one.
    uuid: int = 1
    #: Level of the ``ftc10d`` logger in the workers (None: silent).
    log_level: Optional[int] = None

    def validate(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world size must be at least 2 (one rank is killed), got {self.world_size}")
        if not 0 <= self.kill_rank < self.world_size:
            raise ValueError(f"kill rank {self.kill_rank} is not in [0, {self.world_size})")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.interval_s < 0 or self.timeout_s <= 0:
            raise ValueError("interval must be >= 0 and timeout > 0")

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.kill_rank]


@dataclass(frozen=True)
class Event:
    t: float  # time.monotonic()
    rank: int  # CLI for the calling process
    kind: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)


# =========================================================================== worker


def contribution(rank: int, step: int) -> float:
    """What ``rank`` adds in ``step``: distinct per rank, so a wrong member list
    gives a wrong sum, and per step, so a stale result is caught too."""
    return float((rank + 1) * (step + 1))


def allreduce_step(pg: ftc10d.ProcessGroup, rank: int, members: list[int], step: int) -> bool:
    """One synchronous allreduce through ``torch.distributed``; True if the sum is right."""
    t = torch.full((NUMEL,), contribution(rank, step))
    dist.all_reduce(t, group=pg)
    expected = sum(contribution(r, step) for r in members)
    return bool(torch.all(t == expected))


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float) -> list[str]:
    store.wait(keys, timedelta(seconds=timeout_s))
    return [v.decode() for v in store.multi_get(keys)]


def run_rank(rank: int, cfg: DemoConfig, port: int, emit: Emit) -> None:
    """Everything one rank does; raises on anything unexpected."""
    timeout = timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    pg = ftc10d.ProcessGroup(store, rank, cfg.world_size, timeout=timeout)

    # Handles name a group object for its whole life, so they can be swapped once, up front.
    store.set(f"{KEY_ROOT}/handles/{rank}", pg.get_reconfigure_handle())
    handles = _wait_keys(store, [f"{KEY_ROOT}/handles/{r}" for r in range(cfg.world_size)], cfg.timeout_s)
    emit("connected", f"connected: rank {pg.rank()} of {pg.size()}, handle {pg.get_reconfigure_handle()}")

    def on_abort() -> None:
        gen = pg.generation
        emit("abort_hook", f"abort hook: {gen.label if gen else 'the configuration'} is being aborted")

    pg.register_abort_hook(1, on_abort)

    # ---- before the failure: allreduce until a peer dies
    everyone = list(range(cfg.world_size))
    step = 0
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        try:
            ok = allreduce_step(pg, rank, everyone, step)
        except ftc10d.CollectiveError as exc:
            err = exc
            break
        if not ok:
            raise AssertionError(f"wrong allreduce result at step {step} before the failure")
        step += 1
        if step == cfg.steps:
            emit("warm", f"{step} allreduce steps done, results correct")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no failure seen within {cfg.timeout_s:g} s")
        time.sleep(cfg.interval_s)
    t_err = time.monotonic()
    emit(
        "error",
        str(err),
        t=t_err,
        type=type(err).__name__,
        peer=err.peer,
        op=err.op,
        seq=err.seq,
        step=step,
    )

    # ---- agree on the survivors (here: the demo knows whom it killed) through the store
    survivors = cfg.survivors
    store.set(f"{KEY_ROOT}/cfg/{cfg.uuid}/member/{rank}", pg.get_reconfigure_handle())
    new_handles = _wait_keys(
        store, [f"{KEY_ROOT}/cfg/{cfg.uuid}/member/{r}" for r in survivors], cfg.timeout_s
    )
    if new_handles != [handles[r] for r in survivors]:
        raise AssertionError("a survivor's handle changed during the life of its group")
    emit("agreed", f"agreed through the store on {len(survivors)} survivors for uuid {cfg.uuid}")

    # ---- rebuild the communicator in place: same process, same group object
    t0 = time.monotonic()
    ftc10d.reconfigure(cfg.uuid, new_handles, group=pg)
    t1 = time.monotonic()
    emit(
        "reconfigured",
        f"reconfigured to generation {cfg.uuid} in {(t1 - t0) * 1e3:.1f} ms: now rank {pg.rank()} of {pg.size()}",
        ms=(t1 - t0) * 1e3,
        new_rank=pg.rank(),
        new_size=pg.size(),
    )

    # ---- carry on in the smaller group
    correct = 0
    for s in range(cfg.steps):
        if allreduce_step(pg, rank, survivors, s):
            correct += 1
        else:
            emit("wrong", f"wrong allreduce result at step {s} after the reconfigure")
        if s == 0:
            emit("resumed", "first allreduce of the new generation done")
        time.sleep(cfg.interval_s)

    # Leave only when every survivor is done: a rank that exits while a peer still
    # reads from it would fail that peer's last allreduce.
    store.set(f"{KEY_ROOT}/done/{rank}", str(correct))
    _wait_keys(store, [f"{KEY_ROOT}/done/{r}" for r in survivors], cfg.timeout_s)
    pg.unregister_abort_hook(1)  # shutdown aborts the generation too; that one is no news
    pg.shutdown()
    emit("done", f"done: {correct}/{cfg.steps} allreduce results correct", correct=correct)


def worker(rank: int, cfg: DemoConfig, port: int, conn: Connection) -> None:
    """Entry point of one rank, in its own process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if cfg.log_level is not None:
        logging.basicConfig(level=cfg.log_level, format=f"[rank {rank}] %(name)s %(levelname)s: %(message)s")
        logging.getLogger("ftc10d").setLevel(cfg.log_level)

    def emit(kind: str, text: str, t: Optional[float] = None, **data: Any) -> None:
        conn.send(Event(time.monotonic() if t is None else t, rank, kind, text, data))

    code = 0
    try:
        run_rank(rank, cfg, port, emit)
    except BaseException as exc:  # report everything; the parent decides
        try:
            emit("crash", f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        except Exception:
            pass
        code = 1
    conn.close()
    # Hard exit: skip interpreter teardown, where Gloo threads of the aborted
    # generation may still be winding down.
    os._exit(code)


# =========================================================================== parent


@dataclass
class RankState:
    pid: int = 0
    warm: bool = False
    error: Optional[Event] = None
    reconfigured: Optional[Event] = None
    resumed: Optional[Event] = None
    done: Optional[Event] = None
    crash: Optional[Event] = None
    exited: bool = False


class Timeline:
    """Collects events and prints them, as they come (live) or sorted at the end."""

    def __init__(self, t0: float, live: bool, out: TextIO) -> None:
        self.t0 = t0
        self.live = live
        self.out = out
        self.events: list[Event] = []

    def add(self, ev: Event) -> None:
        self.events.append(ev)
        if self.live:
            self._print(ev)

    def flush(self) -> None:
        if not self.live:
            for ev in sorted(self.events, key=lambda e: e.t):
                self._print(ev)

    def _print(self, ev: Event) -> None:
        who = "cli   " if ev.rank == CLI else f"rank {ev.rank}"
        head = f"[+{ev.t - self.t0:7.3f} s] {who}  "
        if ev.kind == "error":
            kill_t = ev.data.get("kill_t")
            after = f" {(ev.t - kill_t) * 1e3:.1f} ms after the kill" if kill_t is not None else ""
            peer = ev.data.get("peer")
            named = f", names peer rank {peer}" if peer is not None else ", names no peer"
            print(f"{head}{ev.data.get('type')}{after}{named}:", file=self.out)
            print(textwrap.fill(ev.text, width=110, initial_indent=" " * 22, subsequent_indent=" " * 22), file=self.out)
        elif ev.kind == "crash":
            print(f"{head}FAILED: {ev.text}", file=self.out)
            tb = ev.data.get("traceback")
            if tb:
                print(textwrap.indent(tb.rstrip(), " " * 22), file=self.out)
        else:
            print(f"{head}{ev.text}", file=self.out)
        self.out.flush()


def _summary(cfg: DemoConfig, states: dict[int, RankState], kill_t: Optional[float], out: TextIO) -> bool:
    """Print one line per survivor; True if every survivor finished with correct results."""
    print(f"\nsummary ({len(cfg.survivors)} survivors of {cfg.world_size}, rank {cfg.kill_rank} killed):", file=out)
    print(f"  {'rank':<5}{'error seen':<24}{'peer named':<12}{'detected':>10}{'reconfigure':>13}{'stall':>10}  results",
          file=out)

    def ms(a: Optional[float], b: Optional[float]) -> str:
        return "-" if a is None or b is None else f"{(a - b) * 1e3:.1f} ms"

    all_ok = True
    stalls = []
    for r in cfg.survivors:
        st = states[r]
        err = st.error
        ok = st.done is not None and st.done.data.get("correct") == cfg.steps
        all_ok &= ok
        reconf = f"{st.reconfigured.data['ms']:.1f} ms" if st.reconfigured else "-"
        if st.resumed is not None and kill_t is not None:
            stalls.append((st.resumed.t - kill_t) * 1e3)
        if st.done is not None:
            result = f"{st.done.data.get('correct')}/{cfg.steps} correct"
        elif st.crash is not None:
            result = "FAILED: " + st.crash.text.splitlines()[0][:60]
        else:
            result = "did not finish"
        peer = "-" if err is None or err.data.get("peer") is None else str(err.data["peer"])
        print(
            f"  {r:<5}{(err.data.get('type') if err else 'none'):<24}{peer:<12}"
            f"{ms(err.t if err else None, kill_t):>10}{reconf:>13}"
            f"{ms(st.resumed.t if st.resumed else None, kill_t):>10}  {result}",
            file=out,
        )
    print("  (detected, stall: from the SIGKILL to the typed error, and to the first allreduce of the new generation)",
          file=out)
    misnamed = [r for r in cfg.survivors if states[r].error is not None
                and states[r].error.data.get("peer") not in (None, cfg.kill_rank)]
    if any(states[r].error is not None and states[r].error.data.get("type") == "ProcessGroupAborted"
           for r in cfg.survivors):
        print("  ProcessGroupAborted: another member's abort cut this rank's connection before anyone "
              "had named the dead rank", file=out)
    if misnamed:
        print(f"  note: rank(s) {misnamed} named another peer than the killed rank {cfg.kill_rank}", file=out)
    if all_ok:
        worst = f"; worst stall {max(stalls):.1f} ms" if stalls else ""
        n = len(cfg.survivors)
        who = f"the {n} survivors rebuilt their" if n > 1 else "the survivor rebuilt its"
        each = " each" if n > 1 else ""
        print(f"\nOK: {who} group in place (no restart, no checkpoint) and finished {cfg.steps} correct "
              f"allreduces{each}{worst}.", file=out)
    else:
        print("\nFAILED: not every survivor finished with correct allreduce results.", file=out)
    return all_ok


def run(cfg: DemoConfig, *, live: bool = True, out: TextIO = sys.stdout) -> int:
    """Host the store, start the ranks, kill one, report. Returns 0 on success, 1 otherwise."""
    cfg.validate()
    from ftc10d.examples import reconfigure_after_kill as this  # importable target, even when run as __main__

    ctx = mp.get_context("forkserver")
    # Import torch once in the fork server rather than once per rank.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ftc10d", this.__name__])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout_s))
    t0 = time.monotonic()
    timeline = Timeline(t0, live, out)
    print(f"ftc10d demo: {cfg.world_size} ranks allreduce over Gloo; rank {cfg.kill_rank} is SIGKILLed after "
          f"{cfg.steps} steps; the survivors reconfigure in place and run {cfg.steps} more "
          f"(torch {torch.__version__}, ftc10d {ftc10d.__version__})\n", file=out)
    timeline.add(Event(t0, CLI, "start", f"hosting the TCPStore on 127.0.0.1:{store.port}; "
                                          f"starting {cfg.world_size} worker processes"))

    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    states = {r: RankState() for r in range(cfg.world_size)}
    kill_t: Optional[float] = None
    try:
        for r in range(cfg.world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=this.worker, args=(r, cfg, store.port, send), name=f"ftc10d-demo-rank{r}",
                            daemon=True)
            p.start()
            send.close()  # the child holds the only write end: its death reads as EOF here
            procs.append(p)
            conns[recv] = r
            states[r].pid = p.pid
        deadline = t0 + cfg.timeout_s + 30.0
        survivors = set(cfg.survivors)

        def finished() -> bool:
            return all(states[r].done or states[r].crash or states[r].exited for r in survivors)

        while not finished():
            if time.monotonic() > deadline:
                timeline.add(Event(time.monotonic(), CLI, "crash", "the demo did not finish in time; stopping"))
                break
            for conn in wait_for_connections(list(conns), timeout=0.2):
                r = conns[conn]
                try:
                    ev: Event = conn.recv()
                except (EOFError, OSError):
                    del conns[conn]
                    states[r].exited = True
                    procs[r].join(1)
                    if r in survivors and not (states[r].done or states[r].crash):
                        timeline.add(Event(time.monotonic(), CLI, "crash",
                                           f"rank {r} exited (code {procs[r].exitcode}) before finishing"))
                    continue
                st = states[r]
                if ev.kind == "error" and kill_t is not None:
                    ev.data["kill_t"] = kill_t
                if ev.kind in ("error", "reconfigured", "resumed", "done", "crash"):
                    setattr(st, ev.kind, ev)
                if ev.kind == "warm":
                    st.warm = True
                timeline.add(ev)
            if kill_t is None and all(s.warm for s in states.values()):
                victim = procs[cfg.kill_rank]
                kill_t = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                timeline.add(Event(kill_t, CLI, "kill", f"SIGKILL -> rank {cfg.kill_rank} (pid {victim.pid})"))
            if kill_t is None and any(s.crash or s.exited for s in states.values()):
                timeline.add(Event(time.monotonic(), CLI, "crash", "a rank failed before the kill; stopping"))
                break
    finally:
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(5)
        for conn in conns:
            conn.close()
    timeline.flush()
    return 0 if _summary(cfg, states, kill_t, out) else 1


def main(
    world_size: int = 4,
    kill_rank: int = 2,
    steps: int = 20,
    *,
    live: bool = True,
    timeout_s: float = 60.0,
    log_level: Optional[int] = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run the demo; returns the process exit code (0: survivors finished correctly)."""
    cfg = DemoConfig(world_size=world_size, kill_rank=kill_rank, steps=steps, timeout_s=timeout_s,
                     log_level=log_level)
    return run(cfg, live=live, out=out)


if __name__ == "__main__":
    sys.exit(main())

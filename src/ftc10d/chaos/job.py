"""The training job of a chaos trial: the script every launcher slot (and warm spare) runs.

A small MLP trained with DDP through ftc10d (``Manager``, ``ManagedOptimizer``) on a
fixed sequence of global batches. It writes what the checks need as JSON lines
to ``<out>/events/<slot>-<pid>.jsonl``, one ``write`` per line, so a SIGKILL loses
nothing already written and the files outlive the coordinator store:

- ``start``; ``admitted`` (member id, epoch, rank, world size);
- ``commit`` per committed step: step, state fingerprint, member id, epoch (the member's
  newest, which may run ahead of the step's), uuid of the configuration the step ran in;
- ``aborted`` per step not committed; the Manager's ``reconfigured`` /
  ``recovered`` (with the fingerprint of the received state) / ``sent_state`` /
  ``aborted_step`` / ``fenced`` (with the member id that was fenced);
- ``final`` (state_hash) at the last step, ``left`` if it was out of the job (fenced,
  or left out of a re-formed configuration) when the others finished, ``exit``;
- ``guard_abort`` / ``guard_check`` / ``guard_violation``: invariant 2 under the trial's
  faults, from guard ops kept in flight through every step (:mod:`ftc10d.chaos.guard`).

Options come as JSON in ``$FTC10D_CHAOS_OPTS``: ``out``, ``trial``, ``steps``,
``interval``, ``world`` and ``rank_base`` (a trial with several hosts runs one
launcher per host; the job, not the launcher, knows the whole job's size), and
``die``: ``{slot: {"op": "send"|"vote"|"after_vote", "after_step": n}}``: SIGKILL itself as it
sends state to a joiner, inside the commit vote, or once its own vote completed; only the first process of the
trial to get there dies (claimed through the coordinator store).

``mesh`` (``[R, S]``, ``ftc10d chaos --mesh``) makes it an FT-HSDP job: the same model sharded
by FSDP2 over each replica's S ranks (one seed on every rank, as FSDP2 needs), the commit
across the replicas that train, the step's batch split over every rank that trains. Its
``commit``, ``recovered`` and ``final`` events carry the rank's ``shard`` index: replicas agree
per shard. Its guard ops run on the group of the ranks that train (a rank of an incomplete
replica waits and issues nothing), and ``die: vote`` hooks that group (the FT-HSDP vote's).

Kept free of ``tests/`` so that ``ftc10d chaos`` runs from an installed package.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

# Top-level imports: a warm spare imports these before it is needed.
import torch
import torch._dynamo  # noqa: F401  (the first optimizer step imports it: seconds on a busy machine)
import torch.distributed as dist
import torch.nn.parallel  # noqa: F401
from torch import nn
from torch.distributed.fsdp import fully_shard

from ftc10d.store_connect import connect_client
from ftc10d.chaos.guard import Guards
from ftc10d.launch import EXIT_STOP_JOB
from ftc10d.train import ManagedOptimizer, Manager, init_from_env
from ftc10d.types import JobFinished, ReplicaDivergenceError, StateLostError

OPTS_ENV = "FTC10D_CHAOS_OPTS"
IN, HIDDEN, OUT, GLOBAL_BATCH = 32, 64, 4, 64
LR = 1e-2
#: A worker short of the final step this long after the first one finished is out of the job.
STRANDED_S = 10.0
#: A step (from zero_grad to the next one) longer than this dumps every thread's stack to the log.
STUCK_DUMP_S = 5.0


class _StuckDump:
    """Write every thread's Python stack to stderr once a step has run ``seconds`` (re-armed each
    step). Not ``faulthandler.dump_traceback_later``: its watchdog reads the other threads'
    frames without the GIL while they run, and a worker resumed from a SIGSTOP died of it
    (SIGSEGV, in a CI run of the stale-member test). This one reads them under the GIL
    (``sys._current_frames``): a thread that holds the GIL in C++ delays the dump, never
    crashes it."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._deadline: Optional[float] = None
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="ftc10d-chaos-stuck-dump", daemon=True).start()

    def arm(self) -> None:
        with self._cond:
            self._deadline = time.monotonic() + self._seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._deadline is None or time.monotonic() < self._deadline:
                    self._cond.wait(None if self._deadline is None else self._deadline - time.monotonic())
                self._deadline = None  # once per step
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"Timeout ({self._seconds:g} s): a step is still running; every thread's stack:\n"]
            for ident, frame in sys._current_frames().items():
                lines.append(f"Thread {ident:#x} ({names.get(ident, '?')}):\n")
                lines.extend(traceback.format_stack(frame))
            sys.stderr.write("".join(lines))
            sys.stderr.flush()


def batch_for(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard of step ``step``'s fixed global batch that rank ``rank`` of ``world`` trains on."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
    return x[rank::world], y[rank::world]


class EventLog:
    """Append-only JSON lines, one ``write`` each (nothing buffered in the process)."""

    def __init__(self, folder: str, slot: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self._fd = os.open(os.path.join(folder, f"{slot}-{os.getpid()}.jsonl"),
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.slot = slot

    def emit(self, kind: str, **info: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "pid": os.getpid(), "slot": self.slot, **info}
        os.write(self._fd, (json.dumps(rec, default=str) + "\n").encode())


def suicide_hook(manager: Manager, die: dict[str, Any], claim: Callable[[str], bool], log: EventLog,
                 guards: Optional[Guards] = None, is_armed: Callable[[str], bool] = lambda key: True) -> Any:
    """A pre-hook that SIGKILLs this process as it issues a state-transfer send (``op: send``)
    or its commit-vote all-reduce (``op: vote``), once ``manager.step >= after_step``, if it
    wins the trial-wide claim for that op. A guard send is not a state transfer: left alone.
    ``gated`` (``--mesh``): only once the trial set ``armed/<op>`` (``is_armed``), when the mesh
    was whole."""

    armed = [not die.get("gated")]

    def hook(args: Any) -> None:
        if manager.step < die["after_step"] or (guards is not None and guards.issuing):
            return
        name = str(args.name).lower().replace("_", "")
        hit = (die["op"] == "send" and name.endswith("send")) or (
            die["op"] in ("vote", "after_vote") and name.endswith("allreduce") and manager.in_vote)
        if hit and not armed[0]:
            armed[0] = is_armed(f"armed/{die['op']}")
        if hit and armed[0] and claim(f"die/{die['op']}"):
            if die["op"] == "after_vote":  # a post-hook: the vote was issued; die once it completed here
                try:
                    args.work.wait()
                except Exception:
                    return  # it failed here: not the interleaving this fault is for
            log.emit("suicide", op=die["op"], step=manager.step)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class Control:
    """The coordinator store, for the job's own keys (finish barrier, claims). Reconnects
    on the next call after a failure: the store may be cut off, or killed and restarted."""

    def __init__(self) -> None:
        self._store: Any = None

    def call(self, fn: Callable[[dist.TCPStore], Any]) -> Any:
        for attempt in (0, 1):  # a connection from before a store restart fails once: reconnect
            try:
                if self._store is None:
                    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
                    self._store = connect_client(host.strip("[]"), int(port), timedelta(seconds=5))
                return fn(self._store)
            except Exception:
                self._store = None
                if attempt:
                    raise


def _finished(control: Control, key: str) -> bool:
    try:
        return bool(control.call(lambda s: s.check([key])))
    except Exception:  # the store unreachable (a cut link, a restart): not known to be finished
        return False


def _claim(control: Control, key: str) -> bool:
    try:
        return int(control.call(lambda s: s.add(key, 1))) == 1
    except Exception:
        return False


def _exit(log: EventLog, code: int = 0) -> None:
    log.emit("exit", code=code)
    sys.stdout.flush()
    sys.stderr.flush()
    # Hard exit: at interpreter teardown Gloo threads of retired generations can abort the
    # process, which the launcher would read as a crash.
    os._exit(code)


def _fsdp(manager: Manager, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FT-HSDP: the model sharded over this rank's replica (waits until the replica is
    complete) and its optimizer. FSDP2 needs the same initial model on every rank: one
    seed, not the slot's."""
    mesh = manager.device_mesh()
    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    optim = torch.optim.Adam(sharded.parameters(), lr=lr)
    manager.fsdp(sharded, optim)
    return sharded, optim


def main() -> int:
    opts = json.loads(os.environ[OPTS_ENV])
    # The library's own account of every reconfiguration, into the worker's log file: what a
    # failed trial is diagnosed from.
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {os.getpid()} %(name)s %(levelname)s: %(message)s")
    torch.set_num_threads(1)
    slot = int(opts.get("rank_base", 0)) + int(os.environ.get("LOCAL_RANK", "0"))
    # The launcher of one host only knows its own workers; the job's size is the trial's.
    os.environ["WORLD_SIZE"] = str(opts.get("world", os.environ.get("WORLD_SIZE", "1")))
    # Likewise min_members: whoever forms the first configuration stores its own value in it,
    # and a one-worker host's launcher can only say 1 (a minority could then form alone).
    if "min_members" in opts:
        os.environ["FTC10D_MIN_MEMBERS"] = str(opts["min_members"])
    os.environ["RANK"] = str(slot)
    restart = int(os.environ.get("FTC10D_RESTART_COUNT", "0"))
    log = EventLog(os.path.join(opts["out"], "events"), slot)
    log.emit("start", restart=restart)
    try:
        return _train(opts, slot, restart, log)
    except StateLostError as exc:  # the job's newest state is gone: it stops (the trial checks that it did)
        logging.getLogger("ftc10d").error("chaos job: %s", exc)
        log.emit("state_lost_exit", error=str(exc)[:1000])
        _exit(log, EXIT_STOP_JOB)
        return EXIT_STOP_JOB


def _train(opts: dict[str, Any], slot: int, restart: int, log: EventLog) -> int:
    control = Control()
    finished = f"chaos/{opts['trial']}/finished"
    if _finished(control, finished):  # a replacement started as the job ended: nothing to join
        log.emit("left", reason="the job had finished")
        _exit(log)

    torch.manual_seed(slot + 1000 * restart)  # different weights on purpose: recovery makes replicas equal
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    done = threading.Event()
    joined: dict[str, Any] = {}  # "manager" once admitted

    def watch_finish() -> None:
        """A worker left out of the last configuration (fenced and rejoining, re-forming after
        a store restart, or a replacement started as the job ended and still being admitted,
        inside ``init_from_env``) waits for a configuration that will never form once the
        others finished and left. The others reach the final step within milliseconds of
        each other, so a worker still short of it 10 s after the first finisher is stranded:
        it leaves, which is what a job would do."""
        store = Control()  # a connection of its own: TCPStore clients are not thread-safe
        first: Optional[float] = None
        while not done.is_set():
            if first is None and _finished(store, finished):
                first = time.monotonic()
            if first is not None and time.monotonic() - first > STRANDED_S and not done.is_set():
                mgr = joined.get("manager")
                log.emit("left", reason="the job finished while this worker was out of it",
                         step=mgr.step if mgr is not None else None)
                _exit(log)
            time.sleep(0.2)

    threading.Thread(target=watch_finish, name="chaos-finish-watch", daemon=True).start()
    pg, member = init_from_env()
    mesh_opt = opts.get("mesh")
    groups: Any = None
    if mesh_opt:
        from ftc10d.train.fsdp import HSDPGroups
        from ftc10d.train.mesh import HSDPLayout

        groups = HSDPGroups(pg.store, HSDPLayout(*mesh_opt), slot, backend=pg.adapter_name)
    manager = Manager(pg, member, sync_timeout=float(opts.get("sync_timeout", 120.0)), hsdp=groups)
    joined["manager"] = manager
    shard: dict[str, Any] = {} if groups is None else {"shard": groups.shard_index}
    log.emit("admitted", member=member.id, epoch=manager.epoch, rank=manager.rank, world_size=manager.world_size,
             **shard)
    # FT-HSDP: guard ops and the vote run among the ranks that train (a rank of an incomplete
    # replica issues nothing until its replica is whole again).
    train_pg = pg if groups is None else groups.participants
    guards = Guards(train_pg, log.emit)

    def on_event(kind: str, info: dict[str, Any]) -> None:
        extra: dict[str, Any] = {"member": manager.member.id, "epoch_now": manager.epoch}
        if kind in ("recovered", "rolled_forward"):
            extra.update(shard)
            # FT-HSDP: a replacement receives its shard before it built the sharded model; the
            # Manager keeps it until fsdp() registers the model: no state to fingerprint yet.
            if groups is None or manager.registered_fsdp:
                extra["fp"] = manager.fingerprint()
        log.emit(kind, **info, **extra)
        if kind == "reconfigured":
            guards.check("reconfigured")

    manager.add_listener(on_event)
    die = opts.get("die", {}).get(str(slot))
    if die:
        claim_prefix = f"chaos/{opts['trial']}/"
        hook = suicide_hook(manager, die, lambda k: _claim(control, claim_prefix + k), log, guards,
                            lambda k: _finished(control, claim_prefix + k))
        hooked = pg if die["op"] == "send" else train_pg
        if die["op"] == "after_vote":
            hooked.register_post_hook(7, hook)
        else:
            hooked.register_pre_hook(7, hook)
    if groups is None:
        forward: Callable[[torch.Tensor], torch.Tensor] = manager.ddp(model)
    else:
        try:
            forward, optim = _fsdp(manager, LR)
        except JobFinished as exc:  # a replacement that arrived as the others finished
            log.emit("left", reason=str(exc))
            _exit(log)
    opt = ManagedOptimizer(manager, optim)
    steps = int(opts["steps"])
    interval = float(opts.get("interval", 0.0))
    stuck = _StuckDump(STUCK_DUMP_S)
    while manager.step < steps:
        # A step that takes longer than any pause the trial allows dumps every thread's stack into
        # the worker's log (diagnosis of a long pause; a recovery's waits dump too: read them so).
        stuck.arm()
        try:
            opt.zero_grad()
        except JobFinished as exc:  # FT-HSDP: waited for its replica while the others finished
            log.emit("left", reason=str(exc), step=manager.step)
            _exit(log)
        # Guard ops in flight through the step (invariant 2): outputs no training tensor uses.
        guards.issue(manager.step)
        x, y = batch_for(manager.step, train_pg.rank(), train_pg.size())
        with manager.collectives():  # FT-HSDP: a failed collective fails the step (DDP: no-op)
            loss = nn.functional.cross_entropy(forward(x), y)
            loss.backward()
        guards.send(manager.step)
        guards.settle(manager.step, manager.note_failure)
        if opt.step():
            log.emit("commit", step=manager.step, fp=manager.fingerprint(), member=manager.member.id,
                     epoch=manager.epoch, commit_epoch=manager.commit_epoch, uuid=pg.uuid,
                     world_size=manager.world_size, **shard)
        else:
            log.emit("aborted", step=manager.step, member=manager.member.id)
        if interval:
            time.sleep(interval)
    stuck.disarm()
    done.set()
    guards.check("exit")
    log.emit("final", step=manager.step, hash=manager.state_hash(), member=manager.member.id, **shard)
    # Stay until every member of the last configuration finished, so that one leaving early
    # does not look like a failure to the others' last step.
    try:
        control.call(lambda s: s.add(finished, 1))
        deadline = time.monotonic() + 20
        while int(control.call(lambda s: s.add(finished, 0))) < manager.world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception as exc:  # the store gone: leave anyway
        log.emit("warning", error=f"finish barrier: {exc}")
    manager.close()
    _exit(log)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ReplicaDivergenceError:  # logged as a "diverged" event; the whole job stops (a violation)
        logging.getLogger("ftc10d").exception("chaos job: the replicas diverged")
        os._exit(EXIT_STOP_JOB)

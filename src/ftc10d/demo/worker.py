"""The demo's training script, run by the launcher in every slot (and in warm spares).

It trains :mod:`ftc10d.demo.model` with DDP through ftc10d and appends one JSON
line per event to ``<out>/events/<slot>-<pid>.jsonl`` (written and flushed line by
line, so the driver can tail it): ``start``, ``admitted``, ``step`` (committed or
not, with loss and timings), the Manager's ``reconfigured`` / ``recovered`` /
``sent_state`` / ``aborted_step`` / ``fenced``, ``fingerprint`` every
``--fp-every`` committed steps, and ``final`` (state_hash) at the end.

Usage (what the driver passes): ``worker.py --out DIR --steps N [--fp-every K] [--lr X]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

# Imported at the top so that a warm spare (ftc10d.launch.spare imports a script's top-level
# imports before it is needed) pays for them: torch._dynamo is what the first optimizer
# constructed imports (~2 s on a busy 2-core machine), torch.nn.parallel is DDP.
import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn.parallel  # noqa: F401
from torch.distributed.fsdp import fully_shard

from ftc10d.demo.faults import parse_mesh
from ftc10d.demo.model import batch_for, loss_fn, make_student, make_teacher
from ftc10d.train import ManagedOptimizer, Manager, init_from_env
from ftc10d.launch import EXIT_STOP_JOB
from ftc10d.types import JobFinished, ReplicaDivergenceError


class EventLog:
    """One JSONL file per process; ``emit`` writes a line and flushes it."""

    def __init__(self, out: Path, slot: int) -> None:
        folder = out / "events"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{slot}-{os.getpid()}.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self.slot = slot

    def emit(self, kind: str, **info: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "pid": os.getpid(), "slot": self.slot, **info}
        self._f.write(json.dumps(rec, default=str) + "\n")

    def close(self) -> None:
        self._f.close()


def warm_up() -> None:
    """Pay torch's remaining first-use costs before this process is admitted, so that a
    replacement is ready to train the moment it joins."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([p])
    (p * 2).sum().backward()
    opt.step()
    opt.zero_grad()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ftc10d-demo-worker")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fp-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--job", default=None, metavar="ID",
                   help="the job's id for the workers' own store keys (default: the launcher's id; give one when "
                        "several launchers run the job, one per node)")
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="RxS",
                   help="FT-HSDP: R replicas of S ranks, FSDP2 inside each replica (R*S workers)")
    p.add_argument("--min-step-time", type=float, default=0.0, metavar="SECONDS",
                   help="pace the steps to at least this long (a stand-in for a bigger model's compute)")
    p.add_argument("--plain", action="store_true", help="plain torch DDP over init_process_group('gloo') (bench)")
    p.add_argument("--ab-block", type=int, default=0, metavar="N",
                   help="bench: alternate blocks of N steps of plain DDP and ftc10d DDP in this process")
    p.add_argument("--ab-check", type=int, default=0, metavar="K",
                   help="bench, with --ab-block: a third mode, ftc10d comparing the replicas every K steps "
                        "(Manager check_every=K; the ftc10d mode then runs with check_every=0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("FTC10D_LOG_LEVEL"):  # e.g. INFO: the library's account of each reconfigure, in logs/
        logging.basicConfig(level=os.environ["FTC10D_LOG_LEVEL"].upper(),
                            format=f"%(asctime)s {os.getpid()} %(threadName)s %(name)s %(levelname)s: %(message)s")
    torch.set_num_threads(1)
    slot = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("FTC10D_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    log = EventLog(Path(args.out), slot)
    log.emit("start", restart=restart, plain=args.plain)
    if args.plain:
        return _plain(args, log, slot, restart)
    if args.ab_block:
        return _ab_hsdp(args, log, slot) if args.mesh is not None else _ab(args, log, slot)
    try:
        if args.mesh is not None:
            return _hsdp(args, log, slot, restart)
        return _ftc10d(args, log, slot, restart)
    except ReplicaDivergenceError as exc:  # the Manager logged a "diverged" event: stop the whole job
        log.emit("stopped", reason=str(exc))
        log.close()
        sys.stderr.write(f"ftc10d demo worker: {exc}\n")
        sys.stderr.flush()
        os._exit(EXIT_STOP_JOB)


def _device(slot: int) -> torch.device:
    """Where the model trains: ``$FTC10D_DEMO_DEVICE`` (``cuda`` in ``make gpu-check``; default
    ``cpu``). On CUDA each worker takes the GPU ``LOCAL_RANK`` modulo the GPUs there are (ranks
    sharing one GPU need a per-rank ``NCCL_HOSTID``, which ``ftc10d launch`` sets)."""
    kind = os.environ.get("FTC10D_DEMO_DEVICE", "cpu")
    if kind != "cuda":
        return torch.device(kind)
    index = int(os.environ.get("LOCAL_RANK", slot)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _ftc10d(args: argparse.Namespace, log: EventLog, slot: int, restart: int) -> int:
    # Everything that does not need the group comes before joining: once admitted, the others
    # wait for this process at the next rendezvous.
    device = _device(slot)  # before the group: its NCCL channel connects on the current device
    warm_up()
    teacher = make_teacher()
    model = make_student(seed=slot + 1000 * restart).to(device)  # different on purpose: recovery makes them equal
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    finished, joining = _ready(args, log, restart)
    pg, member = init_from_env()
    manager = Manager(pg, member)
    log.emit("admitted", rank=manager.rank, world_size=manager.world_size, epoch=manager.epoch)
    manager.add_listener(lambda kind, info: log.emit(kind, **info))
    manager.add_listener(lambda kind, info: joining.__setitem__(0, True) if kind == "fenced" else None)
    ddp = manager.ddp(model)
    opt = ManagedOptimizer(manager, optim)

    def step() -> torch.Tensor:
        x, y = batch_for(teacher, manager.step, manager.rank, manager.world_size)
        loss = loss_fn(ddp(x.to(device)), y.to(device))
        loss.backward()
        return loss

    return _train(args, log, manager, opt, finished, joining, step, lambda: {}, {})


def _hsdp(args: argparse.Namespace, log: EventLog, slot: int, restart: int) -> int:
    """FT-HSDP: FSDP2 over this replica's shard group, the Manager commits across replicas.
    A replica that lost a rank waits (in ``zero_grad``) until its replacement arrived, then
    trains on with the shards it received."""
    from ftc10d.train.fsdp import HSDPGroups
    from ftc10d.train.mesh import HSDPLayout

    device = _device(slot)  # before the group: its NCCL channel connects on the current device
    warm_up()
    teacher = make_teacher()
    finished, joining = _ready(args, log, restart)
    pg, member = init_from_env()
    replicas, shard_size = args.mesh
    groups = HSDPGroups(pg.store, HSDPLayout(replicas, shard_size), slot, backend=pg.adapter_name)
    manager = Manager(pg, member, hsdp=groups)
    log.emit("admitted", rank=manager.rank, world_size=manager.world_size, epoch=manager.epoch,
             replica=groups.replica, shard=groups.shard_index)
    manager.add_listener(lambda kind, info: log.emit(kind, **info))
    manager.add_listener(lambda kind, info: joining.__setitem__(0, True) if kind == "fenced" else None)
    try:
        mesh = manager.device_mesh()  # waits until this rank's replica is complete
    except JobFinished as exc:  # it arrived after the others finished
        log.emit("left", step=manager.step, reason=str(exc))
        return _exit(log, manager)
    # FSDP2 (like torch's HSDP) needs the same initial model on every rank: one seed for all.
    model = make_student(seed=0).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    manager.fsdp(model, optim)
    opt = ManagedOptimizer(manager, optim)

    def step() -> torch.Tensor:
        # the replicas that train split the step's global batch; so do the ranks of each
        x, y = batch_for(teacher, manager.step, groups.participants.rank(), groups.participants.size())
        x, y = x.to(device), y.to(device)
        loss = torch.zeros((), device=device)
        with manager.collectives():  # a failed collective fails the step, not the loop
            loss = loss_fn(model(x), y)
            loss.backward()
        return loss

    return _train(args, log, manager, opt, finished, joining, step, lambda: {"replicas": groups.replicate.size()},
                  {"shard": groups.shard_index})


def _train(args: argparse.Namespace, log: EventLog, manager: Any, opt: ManagedOptimizer, finished: str,
           joining: list[bool], step: Callable[[], torch.Tensor], step_info: Callable[[], dict[str, Any]],
           state_info: dict[str, Any]) -> int:
    """The training loop of both modes: ``step()`` computes one step's gradients and returns its
    loss; ``step_info()`` adds to each step event, ``state_info`` to the fingerprint and final
    events (FT-HSDP: the shard index the state belongs to)."""
    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
    control = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=30))
    while manager.step < args.steps:
        if joining[0] and control.check([finished]):
            # A replacement or a rejoining worker that arrives after the others finished would
            # otherwise train the whole job again, alone: there is nothing left to join.
            log.emit("left", step=manager.step, reason="the job finished before this worker (re)joined")
            return _exit(log, manager)
        t0 = time.time()
        try:
            opt.zero_grad()
        except JobFinished as exc:  # fenced or replaced, and the others finished meanwhile
            log.emit("left", step=manager.step, reason=str(exc))
            return _exit(log, manager)
        t1 = time.time()
        loss = step()
        ok = opt.step()
        t2 = time.time()
        joining[0] = joining[0] and not ok
        log.emit("step", step=manager.step, ok=ok, loss=float(loss.detach()), t0=t0, t_start=t1 - t0, dt=t2 - t0,
                 epoch=manager.epoch, rank=manager.rank, world_size=manager.world_size, **step_info())
        time.sleep(max(0.0, t0 + args.min_step_time - time.time()))
        if ok and (manager.step % args.fp_every == 0 or manager.step == args.steps):
            log.emit("fingerprint", step=manager.step, fp=manager.fingerprint(), commit_epoch=manager.commit_epoch,
                     **state_info)
    log.emit("final", step=manager.step, hash=manager.state_hash(), epoch=manager.epoch, rank=manager.rank,
             **state_info)
    # Stay until every member of the last configuration finished, so that one leaving early
    # does not look like a failure to the others' last step.
    control.add(finished, 1)
    deadline = time.monotonic() + 20
    while int(control.add(finished, 0)) < manager.world_size and time.monotonic() < deadline:
        time.sleep(0.02)
    return _exit(log, manager)

def _ready(args: argparse.Namespace, log: EventLog, restart: int) -> tuple[str, list[bool]]:
    """Say "ready" (what comes before joining is done) and set up the job's "finished" key and
    the joining flag: a replacement, or a worker fenced while frozen, is (re)joining until its
    first commit, and leaves if the others finish meanwhile."""
    log.emit("ready")
    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
    finished = f"ftc10d/demo/{args.job or os.environ.get('FTC10D_LAUNCH_ID', 'x')}/finished"
    joining = [bool(restart)]
    if restart:
        _leave_if_finished_while_joining(host.strip("[]"), int(port), finished, joining, log)
    return finished, joining


def _leave_if_finished_while_joining(host: str, port: int, finished: str, joining: list[bool],
                                     log: EventLog) -> None:
    """A replacement started as the job ends can be admitted into a configuration that still
    lists a member that has left, and wait in its rendezvous long after the others are gone
    (the training loop's own check comes only after admission). While this process is joining,
    a thread of its own leaves as soon as the others finished."""

    def watch() -> None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        while joining[0]:
            try:
                done = store.check([finished])
            except Exception:  # the coordinator gone: the launcher ends the job anyway
                return
            if done and joining[0]:
                log.emit("left", reason="the job finished while this worker was joining")
                log.emit("exit", step=0)
                log.close()
                os._exit(0)
            time.sleep(0.25)

    threading.Thread(target=watch, name="demo-join-watch", daemon=True).start()


def _exit(log: EventLog, manager: Any) -> int:
    manager.close()
    log.emit("exit", step=manager.step)
    log.close()
    # Hard exit: at interpreter teardown, Gloo threads of retired generations can abort the
    # process ("terminate called without an active exception"), which a launcher reads as a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ab(args: argparse.Namespace, log: EventLog, slot: int) -> int:
    """Bench: the same process trains two copies of the model, one with torch's DDP over a plain
    Gloo group and one with DDP through ftc10d, in alternating blocks (ABBA order), so that both
    see the same machine load. ftc10d's background threads (heartbeats) run during both."""
    warm_up()
    teacher = make_teacher()
    models = {"plain": make_student(seed=0), "ftc10d": make_student(seed=0)}
    optims = {k: torch.optim.Adam(m.parameters(), lr=args.lr) for k, m in models.items()}
    pg, member = init_from_env()
    manager = Manager(pg, member)
    rank, world = manager.rank, manager.world_size
    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
    control = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ftc10d-demo/ab/{os.environ.get('FTC10D_LAUNCH_ID')}",
                                                           control), rank=rank, world_size=world)
    log.emit("admitted", rank=rank, world_size=world, epoch=manager.epoch)
    wrapped = {"plain": torch.nn.parallel.DistributedDataParallel(models["plain"]),
               "ftc10d": manager.ddp(models["ftc10d"])}
    opts: dict[str, Any] = {"plain": optims["plain"], "ftc10d": ManagedOptimizer(manager, optims["ftc10d"])}
    k = 0
    blocks = max(2, args.steps // args.ab_block)
    order: tuple[str, ...] = ("plain", "ftc10d", "ftc10d", "plain")
    if args.ab_check:
        order = ("plain", "ftc10d", "check", "check", "ftc10d", "plain")
        wrapped["check"], opts["check"] = wrapped["ftc10d"], opts["ftc10d"]
    for b in range(blocks):
        mode = order[b % len(order)]
        manager.check_every = args.ab_check if mode == "check" else 0
        for i in range(args.ab_block):
            t0 = time.time()
            opts[mode].zero_grad()
            x, y = batch_for(teacher, k, rank, world)
            loss = loss_fn(wrapped[mode](x), y)
            loss.backward()
            ok = opts[mode].step()
            k += 1
            log.emit("step", step=k, ok=ok is not False, loss=float(loss.detach()), t0=t0, dt=time.time() - t0,
                     mode=mode, block=b, epoch=manager.epoch, rank=rank, world_size=world)
    dist.barrier()
    control.add("ftc10d/demo/ab/finished", 1)
    while int(control.add("ftc10d/demo/ab/finished", 0)) < world:
        time.sleep(0.02)
    return _exit(log, manager)


def _ab_hsdp(args: argparse.Namespace, log: EventLog, slot: int) -> int:
    """Bench, ``--mesh RxS --ab-block N``: the same processes train two copies of the model in
    alternating blocks (ABBA), one with torch's own HSDP (``fully_shard`` over a 2-D
    ``DeviceMesh`` of plain Gloo groups made by ``dist.new_group(backend="gloo")``), one with
    FT-HSDP through the Manager (shard group, replicate hook, commit vote)."""
    from torch.distributed.device_mesh import DeviceMesh

    from ftc10d.train.fsdp import HSDPGroups
    from ftc10d.train.mesh import HSDPLayout

    warm_up()
    teacher = make_teacher()
    pg, member = init_from_env()
    replicas, shard_size = args.mesh
    groups = HSDPGroups(pg.store, HSDPLayout(replicas, shard_size), slot, backend=pg.adapter_name)
    manager = Manager(pg, member, hsdp=groups, check_every=0)
    mesh = manager.device_mesh()
    rank, world = manager.rank, manager.world_size
    # torch's HSDP, by world rank: replica = rank // S (every rank creates every group, in one order)
    shard_groups = [dist.new_group([r * shard_size + i for i in range(shard_size)], backend="gloo")
                    for r in range(replicas)]
    rep_groups = [dist.new_group([r * shard_size + i for r in range(replicas)], backend="gloo")
                  for i in range(shard_size)]
    torch_mesh = DeviceMesh.from_group([rep_groups[rank % shard_size], shard_groups[rank // shard_size]], "cpu",
                                       mesh=torch.arange(world).view(replicas, shard_size),
                                       mesh_dim_names=("replicate", "shard"))
    models = {"plain": make_student(seed=0), "ftc10d": make_student(seed=0)}
    for name, m in models.items():
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=torch_mesh if name == "plain" else mesh)
        fully_shard(m, mesh=torch_mesh if name == "plain" else mesh)
    optims = {k: torch.optim.Adam(m.parameters(), lr=args.lr) for k, m in models.items()}
    manager.fsdp(models["ftc10d"], optims["ftc10d"])
    opts: dict[str, Any] = {"plain": optims["plain"], "ftc10d": ManagedOptimizer(manager, optims["ftc10d"])}
    log.emit("admitted", rank=rank, world_size=world, epoch=manager.epoch)
    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
    control = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=60))
    order = ("plain", "ftc10d", "ftc10d", "plain")
    k = 0
    for b in range(max(2, args.steps // args.ab_block)):
        mode = order[b % len(order)]
        for _ in range(args.ab_block):
            t0 = time.time()
            opts[mode].zero_grad()
            x, y = batch_for(teacher, k, rank, world)
            with manager.collectives() if mode == "ftc10d" else contextlib.nullcontext():
                loss = loss_fn(models[mode](x), y)
                loss.backward()
            ok = opts[mode].step()
            k += 1
            log.emit("step", step=k, ok=ok is not False, loss=float(loss.detach()), t0=t0, dt=time.time() - t0,
                     mode=mode, block=b, epoch=manager.epoch, rank=rank, world_size=world)
    control.add("ftc10d/demo/ab/finished", 1)
    while int(control.add("ftc10d/demo/ab/finished", 0)) < world:
        time.sleep(0.02)
    return _exit(log, manager)


def _plain(args: argparse.Namespace, log: EventLog, slot: int, restart: int) -> int:
    """The same job with torch's own DDP and a plain Gloo group (no fault tolerance): the bench baseline."""
    warm_up()
    teacher = make_teacher()
    model = make_student(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    log.emit("ready")
    # torch 2.13's torchrun keeps one agent store across restarts, and a restarted group found
    # the previous attempt's Gloo addresses there ("connectFullMesh failed ... Connection
    # refused"): so the group's keys are namespaced by the attempt.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ftc10d-demo/attempt/{restart}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    log.emit("admitted", rank=rank, world_size=world, epoch=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    step = 0
    while step < args.steps:
        t0 = time.time()
        opt.zero_grad()
        x, y = batch_for(teacher, step, rank, world)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        step += 1
        t2 = time.time()
        log.emit("step", step=step, ok=True, loss=float(loss.detach()), t0=t0, t_start=0.0, dt=t2 - t0, epoch=0,
                 rank=rank, world_size=world)
    dist.barrier()
    log.emit("exit", step=step)
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

"""Worker bodies for the membership tests (run in forkserver processes by tests.harness).

``spec`` says which membership store to use: ``{"kind": "tcp", "host", "port"}`` or
``{"kind": "etcd", "endpoints": [...]}``, plus ``prefix``/``token`` when set.
``port`` (the harness argument) is the test's own TCPStore: the control channel
(``test/stop``, per-rank state) and, unless told otherwise, the pg's rendezvous.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from tests.harness import client_store

CLONE_NEWNET = 0x40000000


def enter_netns(name: Optional[str]) -> None:
    """Move this (still single-threaded) process into network namespace ``name``."""
    if not name:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name}) failed")
    finally:
        os.close(fd)


def make_store(spec: dict[str, Any]) -> Any:
    from ftc10d.membership import EtcdMembershipStore, TCPMembershipStore

    kwargs = {"prefix": spec["prefix"]} if spec.get("prefix") else {}
    if spec["kind"] == "tcp":
        return TCPMembershipStore(spec["host"], spec["port"], **kwargs)
    return EtcdMembershipStore(spec["endpoints"], **kwargs)


def make_member(spec: dict[str, Any], handle: str, opts: dict[str, Any], rank: int = -1) -> Any:
    """``opts["agents"]``: rank -> the socket of the node agent it goes through (node mode)."""
    from ftc10d.membership import Member

    return Member(
        make_store(spec), handle, token=spec.get("token"),
        heartbeat_timeout=opts.get("hb", 1.0), min_members=opts.get("min_members", 1),
        expected=opts.get("expected"), watchers=opts.get("watchers", 2),
        rendezvous_timeout=opts.get("rendezvous_timeout", 10.0),
        node_agent=opts.get("agents", {}).get(str(rank)),
    )


def _log_to(rank: int) -> None:
    """With $FTC10D_TEST_LOG_DIR set, each worker logs ftc10d at INFO to <dir>/rank<r>.log (debugging)."""
    root = os.environ.get("FTC10D_TEST_LOG_DIR")
    if root:
        import logging

        handler = logging.FileHandler(os.path.join(root, f"rank{rank}-{os.getpid()}.log"))
        handler.setFormatter(logging.Formatter("%(created).3f %(threadName)s %(message)s"))
        logging.getLogger("ftc10d").addHandler(handler)
        logging.getLogger("ftc10d").setLevel(logging.INFO)


def _publish(control: dist.Store, rank: int, state: dict[str, Any]) -> None:
    control.set(f"test/state/{rank}", json.dumps(state))


def pg_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """A rank with a real ftc10d ProcessGroup: allreduce in a loop, recover through
    membership (``sync``) after every failure, rejoin as a new member if fenced
    (``opts["rejoin"]``). Publishes its state after every step; returns its history."""
    import torch

    import ftc10d
    from ftc10d.membership import ReconnectingTCPStore
    from ftc10d.membership.store import requests_made

    _log_to(rank)
    control = client_store(port)
    if opts.get("pg_store") == "coordinator":
        # A short store timeout: after the restart, the old generation's keys are gone and a
        # read of them (naming a failed peer) blocks for it.
        base: dist.Store = ReconnectingTCPStore(spec["host"], spec["port"], timeout=timedelta(seconds=5))
    else:
        base = client_store(port)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("pg", base), rank, world,
                             timeout=timedelta(seconds=opts.get("pg_timeout", 20)), enable_reconfigure=True)
    handle = pg.get_reconfigure_handle()
    hold = opts.get("hold", {}).get(str(rank))
    if hold:  # a late joiner, ready to go: joins the membership once the test sets this key
        control.wait([hold], timedelta(seconds=120))
    member = make_member(spec, handle, opts, rank).join().attach(pg)
    events: list[list[Any]] = []
    history: list[list[Any]] = []

    def note(kind: str, *data: Any) -> None:
        events.append([time.monotonic(), kind, *data])

    def applied(cfg: Any) -> None:
        history.append([cfg.epoch, cfg.uuid, list(cfg.handles), member.id])
        note("config", cfg.epoch, cfg.uuid, cfg.size)

    applied(member.sync(pg, timeout=60))
    steps = 0
    fenced = 0
    hang = opts.get("hang", {}).get(str(rank))
    while not control.check(["test/stop"]):
        if hang and control.check([hang]):
            # The training thread hangs (user code, a library bug); the membership's threads
            # go on heartbeating for it.
            note("hung")
            control.wait(["test/stop"], timedelta(seconds=300))
            break
        try:
            cur = member.current()  # a membership operation every step: raises Fenced once removed
            if cur is not None and cur.uuid != pg.uuid:
                applied(member.sync(pg, timeout=60))
            t = torch.ones(8)
            dist.all_reduce(t, group=pg)
            if not bool(torch.all(t == pg.size())):
                raise AssertionError(f"allreduce gave {t[0].item()} in a group of {pg.size()}")
            steps += 1
            _publish(control, rank, {"epoch": member.current().epoch, "uuid": pg.uuid, "size": pg.size(),
                                     "steps": steps, "fenced": fenced, "member": member.id, "handle": handle,
                                     "requests": requests_made(), "t": time.monotonic()})
        except ftc10d.Fenced as exc:
            fenced += 1
            note("fenced", str(exc))
            _publish(control, rank, {"fenced": fenced, "member": member.id, "handle": handle, "epoch": exc.epoch})
            if not opts.get("rejoin"):
                break
            member = member.rejoin().attach(pg)
            note("rejoining", member.id)
            applied(member.sync(pg, timeout=60))
        except ftc10d.CollectiveError as exc:
            if control.check(["test/stop"]):
                break  # a rank that stopped before us broke the collective: not a failure to recover from
            note("error", type(exc).__name__, exc.peer)
            try:
                applied(member.sync(pg, timeout=60))
            except ftc10d.Fenced:
                continue  # handled at the top of the loop
        time.sleep(opts.get("intervals", {}).get(str(rank), opts.get("interval", 0.01)))
    member.close(leave=True)
    return {"handle": handle, "member": member.id, "steps": steps, "events": events, "history": history,
            "fenced": fenced}


class FileControl:
    """The control channel through files, for workers in another network namespace
    (a cut veth must not cut the test's view of them)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def stopped(self) -> bool:
        return os.path.exists(os.path.join(self.root, "stop"))

    def publish(self, rank: int, state: dict[str, Any]) -> None:
        tmp = os.path.join(self.root, f".state-{rank}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self.root, f"state-{rank}.json"))


def read_file_states(root: str, ranks: list[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for r in ranks:
        try:
            with open(os.path.join(root, f"state-{r}.json")) as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def member_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """A member without a ProcessGroup (a fake handle): joins, follows configurations,
    publishes what it holds and its status. Used where the data path is not the
    subject (quorum, partitions across network namespaces)."""
    enter_netns(opts.get("netns", {}).get(str(rank)))
    import ftc10d

    rank += opts.get("rank_offset", 0)
    _log_to(rank)
    if opts.get("state_dir"):
        files = FileControl(opts["state_dir"])
        stopped, publish = files.stopped, lambda st: files.publish(rank, st)
    else:
        control = client_store(port)
        stopped, publish = (lambda: control.check(["test/stop"])), (lambda st: _publish(control, rank, st))
    handle = f"ftc10d/v1/test/{os.getpid()}/{rank:016x}"
    member = make_member(spec, handle, opts).join()
    seen: list[list[Any]] = []
    fenced = ""
    timeout_msg = ""
    last: Any = None
    while not stopped():
        try:
            cfg = member.current()
            if cfg is not None and cfg != last:
                last = cfg
                seen.append([cfg.epoch, cfg.uuid, list(cfg.handles)])
        except ftc10d.Fenced as exc:
            fenced = str(exc)
        status = member.status(refresh=True)
        if status.state == "blocked" and not timeout_msg and last is not None:
            try:
                member.wait_next(last.epoch, timeout=0.2)
            except ftc10d.MembershipTimeoutError as exc:
                timeout_msg = str(exc)
            except ftc10d.MembershipError:
                pass
        publish({"epoch": None if last is None else last.epoch, "size": 0 if last is None else last.size,
                 "uuid": None if last is None else last.uuid, "handles": [] if last is None else list(last.handles),
                 "state": status.state, "detail": status.detail, "member": member.id, "handle": handle,
                 "fenced": bool(fenced), "timeout_msg": timeout_msg})
        time.sleep(0.05)
    member.close(leave=True)
    return {"handle": handle, "member": member.id, "seen": seen, "fenced": fenced}


def recovering_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """``Member.recovering`` (finding 35), ranks 0-1 on a 2-member configuration, ranks 2 and 3
    joining when the test says so.

    A: rank 0 all-reduces inside ``recovering`` and rank 1 never issues it (a peer that went
    straight to a newer configuration): rank 2's join must abort rank 0's op at once, not
    at its 30-s timeout. B: on the 3-member configuration, ranks 0 and 2 all-reduce outside
    a recovery and rank 1 issues it only after rank 3's join was adopted: that join must
    not abort it (a running step finishes, as before)."""
    import torch

    import ftc10d

    _log_to(rank)
    control = client_store(port)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("pg", client_store(port)), rank, world,
                             timeout=timedelta(seconds=opts["pg_timeout"]), enable_reconfigure=True)
    if rank >= 2:
        control.wait([f"test/join{rank}"], timedelta(seconds=120))
    member = make_member(spec, pg.get_reconfigure_handle(), opts, rank).join().attach(pg)
    out: dict[str, Any] = {}

    def wait_epoch_after(epoch: int) -> None:
        deadline = time.monotonic() + 60
        while member.current().epoch <= epoch:
            assert time.monotonic() < deadline, f"rank {rank}: no configuration after epoch {epoch}"
            time.sleep(0.005)

    cfg = member.sync(pg, timeout=60)
    if rank <= 1:  # A
        first = cfg
        assert first.size == 2, first
        if rank == 0:
            t0 = time.monotonic()
            _publish(control, rank, {"phase": "A"})
            try:
                with member.recovering(pg, first):
                    dist.all_reduce(torch.ones(4), group=pg)
                out["A"] = "completed"
            except ftc10d.CollectiveError as exc:
                out["A"] = type(exc).__name__
            out["A_seconds"] = time.monotonic() - t0
            out["A_epoch"] = member.current().epoch
            control.set("test/A_done", "1")
        wait_epoch_after(first.epoch)
        if rank == 1:  # its side of the first configuration stays open meanwhile, as a skipping peer's did
            control.wait(["test/A_done"], timedelta(seconds=2 * opts["pg_timeout"]))
            # entering a recovery in a configuration older than the one held aborts at once
            with member.recovering(pg, first):
                out["entry_aborted"] = pg.get_error() != ftc10d.ErrorType.SUCCESS
        cfg = member.sync(pg, timeout=60)
    if rank <= 2:  # B (rank 3 joins during it)
        assert cfg.size == 3, cfg
        t = torch.ones(4)
        if rank == 1:
            _publish(control, rank, {"phase": "B"})
            wait_epoch_after(cfg.epoch)  # rank 3 was admitted: a join only
            out["B_epoch"] = member.current().epoch
        dist.all_reduce(t, group=pg)
        out["B"] = t.tolist()
        out["B_uuid_kept"] = pg.uuid == cfg.uuid
        wait_epoch_after(cfg.epoch)  # rank 3's join, which the others may not hold yet
        member.sync(pg, timeout=60)
    out["final"] = [member.current().epoch, pg.size()]
    _publish(control, rank, {"done": True})
    control.wait(["test/stop"], timedelta(seconds=120))
    member.close(leave=True)
    return out


def short_sync_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Ranks 0 and 2 call ``sync`` with a deadline much shorter than the rendezvous timeout,
    twice, on configurations rank 1 applies only later (its training thread is busy): a
    rendezvous that the caller's own deadline cut short must not count rank 1 as a no-show
    (two in a row would remove a healthy member). Then all three sync and all-reduce."""
    import torch

    import ftc10d

    _log_to(rank)
    control = client_store(port)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("pg", client_store(port)), rank, world,
                             timeout=timedelta(seconds=30), enable_reconfigure=True)
    if rank == 2:
        control.wait(["test/join2"], timedelta(seconds=120))
    member = make_member(spec, pg.get_reconfigure_handle(), opts, rank).join().attach(pg)
    out: dict[str, Any] = {"short": []}
    if rank <= 1:
        cfg = member.sync(pg, timeout=60)
        assert cfg.size == 2, cfg
        _publish(control, rank, {"on": cfg.epoch})
        while member.current().epoch == cfg.epoch:  # rank 2's join
            time.sleep(0.005)
    if rank != 1:
        for _ in range(3):
            try:
                member.sync(pg, timeout=opts["short"])
                out["short"].append("synced")
            except ftc10d.MembershipTimeoutError:
                out["short"].append("timeout")
        control.add("test/short_done", 1)
    if rank == 1:
        control.wait(["test/release1"], timedelta(seconds=60))
    deadline = time.monotonic() + 60
    while True:
        cfg = member.sync(pg, timeout=60)
        t = torch.ones(2)
        try:
            dist.all_reduce(t, group=pg)
            break
        except ftc10d.CollectiveError:
            assert time.monotonic() < deadline
    out["final"] = [cfg.epoch, cfg.size, t.tolist()]
    _publish(control, rank, {"done": True})
    control.wait(["test/stop"], timedelta(seconds=120))
    member.close(leave=True)
    return out

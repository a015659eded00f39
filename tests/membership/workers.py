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


def make_member(spec: dict[str, Any], handle: str, opts: dict[str, Any]) -> Any:
    from ftc10d.membership import Member

    return Member(
        make_store(spec), handle, token=spec.get("token"),
        heartbeat_timeout=opts.get("hb", 1.0), min_members=opts.get("min_members", 1),
        expected=opts.get("expected"), watchers=opts.get("watchers", 2),
        rendezvous_timeout=opts.get("rendezvous_timeout", 10.0),
    )


def _publish(control: dist.Store, rank: int, state: dict[str, Any]) -> None:
    control.set(f"test/state/{rank}", json.dumps(state))


def pg_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """A rank with a real ftc10d ProcessGroup: allreduce in a loop, recover through
    membership (``sync``) after every failure, rejoin as a new member if fenced
    (``opts["rejoin"]``). Publishes its state after every step; returns its history."""
    import torch

    import ftc10d
    from ftc10d.membership import ReconnectingTCPStore

    control = client_store(port)
    if opts.get("pg_store") == "coordinator":
        base: dist.Store = ReconnectingTCPStore(spec["host"], spec["port"], timeout=timedelta(seconds=30))
    else:
        base = client_store(port)
    pg = ftc10d.ProcessGroup(dist.PrefixStore("pg", base), rank, world,
                             timeout=timedelta(seconds=opts.get("pg_timeout", 20)), enable_reconfigure=True)
    handle = pg.get_reconfigure_handle()
    member = make_member(spec, handle, opts).join().attach(pg)
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
    while not control.check(["test/stop"]):
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
                                     "steps": steps, "fenced": fenced, "member": member.id, "handle": handle})
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
        time.sleep(opts.get("interval", 0.01))
    member.close()
    return {"handle": handle, "member": member.id, "steps": steps, "events": events, "history": history,
            "fenced": fenced}


def member_worker(rank: int, world: int, port: int, spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """A member without a ProcessGroup (a fake handle): joins, follows configurations,
    publishes what it holds and its status. Used where the data path is not the
    subject (quorum, partitions across network namespaces)."""
    enter_netns(opts.get("netns", {}).get(str(rank)))
    import ftc10d

    control = client_store(opts["control_port"]) if opts.get("control_port") else client_store(port)
    handle = f"ftc10d/v1/test/{os.getpid()}/{rank:016x}"
    member = make_member(spec, handle, opts).join()
    seen: list[list[Any]] = []
    fenced = ""
    last: Any = None
    while not control.check(["test/stop"]):
        try:
            cfg = member.current()
            if cfg is not None and cfg != last:
                last = cfg
                seen.append([cfg.epoch, cfg.uuid, list(cfg.handles)])
        except ftc10d.Fenced as exc:
            fenced = str(exc)
        status = member.status(refresh=True)
        _publish(control, rank, {"epoch": None if last is None else last.epoch, "size": 0 if last is None else last.size,
                                 "uuid": None if last is None else last.uuid, "state": status.state,
                                 "detail": status.detail, "member": member.id, "handle": handle,
                                 "fenced": bool(fenced)})
        time.sleep(0.05)
    member.close()
    return {"handle": handle, "member": member.id, "seen": seen, "fenced": fenced}

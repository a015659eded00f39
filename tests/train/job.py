"""The training loop of the Manager tests, shared by forkserver workers (``workers.py``)
and the script that ``ftc10d launch`` runs (``scripts/train_job.py``).

For every committed step it publishes the replica's state fingerprint under
``fp/<step>/<pid>`` through ``publish``: the tests check invariant 1 from those.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn

IN, HIDDEN, OUT, GLOBAL_BATCH = 32, 64, 4, 64


def batch_for(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard of step ``step``'s fixed global batch that rank ``rank`` of ``world`` trains on."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
    return x[rank::world], y[rank::world]


def _suicide_hook(manager: Any, die: dict[str, Any], claim: Callable[[str], bool]) -> Any:
    """A pre-hook that SIGKILLs this process as it issues a given op (a fault at an exact point):
    ``{"op": "send"}`` (sending state to a joiner) or ``{"op": "vote"}`` (the commit vote),
    once ``manager.step >= die["after_step"]``; with ``"once"``, only the first process of
    the job to get there dies (``claim`` decides, through the test's store)."""

    def hook(args: Any) -> None:
        if manager.step < die["after_step"]:
            return
        name = str(args.name).lower().replace("_", "")
        hit = (die["op"] == "send" and name.endswith("send")) or (
            die["op"] == "vote" and name.endswith("allreduce") and manager.in_vote)
        if hit and (not die.get("once") or claim(f"die/{die['op']}")):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class Model(nn.Module):
    """The tests' MLP; with ``big`` > 0 also a ``big``-element parameter whose gradient differs
    per rank, registered last so that DDP puts it alone in the first bucket: its all-reduce
    is still running when the vote, in the last bucket, completes on Gloo's other thread."""

    def __init__(self, big: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
        self.big = nn.Parameter(torch.zeros(big)) if big else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.big is not None:  # a gradient of x.mean() for every element: different on every rank
            out = out + 1e-3 * self.big.sum() * x.mean()
        return out


def train_loop(pg: Any, member: Any, opts: dict[str, Any], publish: Callable[[str, str], None],
               rank: int, claim: Callable[[str], bool] = lambda key: True, store: Any = None) -> dict[str, Any]:
    """Train to ``opts["steps"]`` committed steps; returns what the tests check.

    ``store`` (the test's TCPStore) is needed by the faults that coordinate ranks: ``split_vote``
    (see :func:`_split_vote`) and ``kill_after_vote`` (see :func:`_kill_after_vote`)."""
    from ftc10d.train import ManagedOptimizer, Manager

    torch.manual_seed(rank + 1000 * int(os.environ.get("FTC10D_RESTART_COUNT", "0")))  # different weights
    model = Model(opts.get("big", 0))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = Manager(pg, member, vote=opts.get("vote", "fused"), sync_timeout=opts.get("sync_timeout", 300.0),
                      check_every=opts.get("check_every", 100))
    events: list[list[Any]] = []
    manager.add_listener(lambda kind, info: events.append([time.time(), kind, info]))

    def rolled_back(kind: str, info: dict[str, Any]) -> None:  # a step this rank applied alone, undone
        if kind == "recovered" and info.get("rolled_back"):
            publish(f"rolledback/{info['rolled_back'][0]}/{os.getpid()}", "1")

    manager.add_listener(rolled_back)
    ddp = manager.ddp(model, **({"bucket_cap_mb": 1} if opts.get("big") else {}))
    die = opts.get("die", {}).get(str(rank))
    if die:
        pg.register_pre_hook(7, _suicide_hook(manager, die, claim))
    split = opts.get("split_vote")
    after_commit = _split_vote(manager, split, rank, store, claim) if split else None
    if opts.get("kill_after_vote"):
        _kill_after_vote(manager, opts["kill_after_vote"], rank, store)
    opt = ManagedOptimizer(manager, optim)
    corrupt = opts.get("corrupt", {})  # {"rank": r, "step": s}: rank r alters its model after committing step s
    publish(f"member/{rank}", manager.member.id)
    steps, aborted = opts["steps"], 0
    veto = opts.get("veto", {}).get(str(rank))  # {"step": s}: veto step s once, before backward
    while manager.step < steps:
        opt.zero_grad()
        x, y = batch_for(manager.step, manager.rank, manager.world_size)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if veto is not None and manager.step == veto["step"]:
            manager.veto(f"test veto of step {veto['step']}")
            veto = None
        loss.backward()
        if opt.step():
            publish(f"fp/{manager.step}/{os.getpid()}", manager.fingerprint())
            publish(f"epoch/{manager.step}/{os.getpid()}", str(manager.commit_epoch))  # the configuration that did
            publish(f"progress/{os.getpid()}", str(manager.step))
            if after_commit is not None:
                after_commit()
            if corrupt.get("rank") == rank and manager.step == corrupt["step"]:
                with torch.no_grad():
                    model.net[0].weight[0, 0] += 1e-3
                publish("corrupted_by", manager.member.id)  # its id now: a fenced member rejoins under a new one
        else:
            aborted += 1
        time.sleep(opts.get("interval", 0.0))
    final = manager.state_hash()
    publish(f"final/{os.getpid()}", final)
    return {"pid": os.getpid(), "steps": manager.step, "aborted": aborted, "final": final, "manager": manager,
            "events": json.loads(json.dumps(events, default=str))}


def _wait_key(store: Any, key: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"test store counter {key} did not reach {count}")
        time.sleep(0.01)


def _split_vote(manager: Any, spec: dict[str, Any], rank: int, store: Any,
                claim: Callable[[str], bool]) -> Callable[[], None]:
    """A vote that completes on some ranks and fails on others while a member dies.

    ``spec``: ``step`` (the step whose vote splits), ``losers`` (ranks that see the vote fail),
    ``victim`` (the rank killed meanwhile; every other rank is a winner), ``freeze`` (winners
    SIGSTOP themselves right after committing it: removed, they come back fenced; the test
    resumes them once the losers redid the step in a configuration without them), ``size`` (with
    ``freeze``: the configuration size the losers wait for before going on past the redone step).

    Order (so that nothing depends on timing): every rank's vote completes; the winners commit
    and count ``committed``; a loser then SIGKILLs the victim, reports its exit (as a supervisor
    does) and makes its own vote fail (``Manager.after_vote``), as Gloo fails the last receive of
    an all-reduce whose peer died mid-way. Returns what the training loop calls after each commit."""
    from ftc10d import PeerFailureError

    step, losers, victim = spec["step"], spec["losers"], spec["victim"]
    winners = spec["world"] - 1 - len(losers)
    # Ranks here are the test's process ranks (the configuration may order members otherwise).
    store.set(f"pid/{rank}", str(os.getpid()))
    store.set(f"handle/{rank}", manager.pg.get_reconfigure_handle())
    me = {"split": False, "committed": False, "redone": False}

    if rank in losers:
        def after_vote() -> None:
            if manager.step != step or me["split"]:
                return
            me["split"] = True
            _wait_key(store, f"committed/{step}", winners)
            if claim("split/kill"):
                os.kill(int(store.get(f"pid/{victim}")), signal.SIGKILL)
                manager.member.report_exit(store.get(f"handle/{victim}").decode())
            raise PeerFailureError(f"test: the vote of step {step} lost its last message (rank {victim} died)",
                                   op="allreduce", seq=-1, uuid=manager.pg.uuid)

        manager.after_vote = after_vote

    def after_commit() -> None:
        if rank in losers:
            if spec.get("freeze") and manager.step == step + 1 and not me["redone"]:
                me["redone"] = True
                store.add(f"redone/{step}", 1)
                _wait_key(store, "go", 1)
                deadline = time.monotonic() + 60
                while (manager.member.current() is None or manager.member.current().size < spec["size"]) \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
        elif rank != victim and manager.step == step + 1 and not me["committed"]:
            me["committed"] = True
            store.add(f"committed/{step}", 1)
            if spec.get("freeze"):
                os.kill(os.getpid(), signal.SIGSTOP)

    return after_commit


def _kill_after_vote(manager: Any, spec: dict[str, Any], rank: int, store: Any) -> None:
    """At step ``spec["step"]``, every rank counts its vote as completed (a post-hook waits for
    the vote's all-reduce, the last gradient bucket); rank ``spec["victim"]`` SIGKILLs itself once
    all did, while the first bucket (``opts["big"]``) is still being all-reduced on Gloo's other
    worker thread. An abort hook that takes ``spec["abort_hook_s"]`` (a flight-recorder dump
    does) keeps the aborts of the survivors' configurations running meanwhile."""
    step, victim, world = spec["step"], spec["victim"], spec["world"]
    pg = manager.pg
    fired = [False]
    pg.register_abort_hook(11, lambda: time.sleep(spec.get("abort_hook_s", 0.0)))

    def hook(args: Any) -> None:
        if manager.step != step or fired[0] or not manager.in_vote:
            return
        fired[0] = True
        args.work.wait()
        store.set(f"voted/{step}/{rank}", "1")
        if rank == victim:  # TCPStore.wait returns as the last key is set: no polling delay
            store.wait([f"voted/{step}/{r}" for r in range(world)], timedelta(seconds=60))
            os.kill(os.getpid(), signal.SIGKILL)

    pg.register_post_hook(12, hook)

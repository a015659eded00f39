"""What a chaos trial must show: the invariants, from the job's event files, and no leaks.

Everything here reads data that outlives the trial's processes (event files, the
membership chain read before the coordinator closed, ``/proc``, ``/dev/shm``), so
the checks run after the job, whatever killed what, and unit tests feed them
synthetic events.

Invariant 1 (``check_commits``): for every committed step, all fingerprints that any
worker published are equal (and equal to the fingerprint of a state received for
that step); per worker, commits are strictly consecutive (step s+1 follows s, a
received state sets the step, never backwards), so no committed step is lost or
applied twice; every step 1..N was committed by someone; every final hash is equal.

Invariant 3 (``check_fencing``): a member id that was fenced commits nothing after
its ``fenced`` event; a member id is used by one process only; in the membership
chain a member, once removed, is never in a later configuration (also across a
store restart, from the members' own events); every commit's member was in the
configuration of its epoch.

Invariant 2 (``check_guards``): the job keeps guard ops in flight through every step
(:mod:`ftc10d.chaos.guard`) and checks them itself, where the tensors live: no guard
tensor of an aborted configuration changed after its abort returned, no guard op was
still running then, no pending guard wait reported a torn result as a success. Each
breach is a ``guard_violation`` event, reported here.

One lineage (``check_lineage``): steps committed in a later configuration never go
below those of an earlier one, which catches two groups training apart.

Invariant 8 (``check_one_history``): a step is committed in one configuration only, also when
every holder of it died, and whatever the hashes say (a second history computed from an
equal state commits equal fingerprints). ``check_state_lost``: after a ``stale`` fault killed
every holder of the job's newest state, the job stops with ``StateLostError``.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``folder/*.jsonl`` (a torn last line of a killed writer is skipped)."""
    out: list[dict[str, Any]] = []
    for f in sorted(Path(folder).glob("*.jsonl")):
        for line in f.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "kind" in rec and "pid" in rec:
                out.append(rec)
    return out


def by_pid(events: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each process's events in the order it wrote them (file order, which is its program order)."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        out[e["pid"]].append(e)
    return out


def check_commits(events: list[dict[str, Any]], steps: int, complete: bool = True) -> list[str]:
    """Invariant 1 and completion; returns what broke (empty: nothing). FT-HSDP events carry
    the rank's ``shard`` index: the state of one step is compared among the holders of the
    same shard (ranks of different shard indices hold different parts of the model).
    ``complete=False``: the job was meant to stop early (its state was lost on purpose):
    every step up to the last one committed, but not the final step, is required."""
    problems: list[str] = []
    # Keyed by (step, commit epoch, shard): states of the same step committed in the same
    # configuration must be equal. A step a worker applied alone in an older configuration, while
    # the others redid it in a newer one, is rolled back (its ``recovered`` event says ``rolled_back``).
    fps: dict[tuple[int, Any, Any], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for pid, evs in by_pid(events).items():
        cur: Optional[int] = 0
        for e in evs:
            if e["kind"] == "recovered":
                s = int(e["step"])
                if cur is not None and s < cur and not e.get("rolled_back"):
                    problems.append(f"pid {pid} received the state of step {s} after committing step {cur}: "
                                    "a committed step was lost")
                cur = s
                if "fp" in e:
                    fps[(s, e.get("epoch"), e.get("shard"))][e["fp"]].append(pid)
            elif e["kind"] in ("commit", "rolled_forward"):
                # rolled_forward (FT-HSDP): the step whose vote failed here but completed on others,
                # applied at recovery with this rank's kept gradients: a commit of that step
                s = int(e["step"])
                if cur is not None and s != cur + 1:
                    what = "applied twice" if s <= cur else "skipped"
                    problems.append(f"pid {pid} committed step {s} after step {cur}: a step was {what}")
                cur = s
                epoch = e.get("commit_epoch") if e["kind"] == "commit" else e.get("epoch")
                if "fp" in e:
                    fps[(s, epoch, e.get("shard"))][e["fp"]].append(pid)
    for key in sorted(fps, key=lambda k: (k[0], str(k[1]), str(k[2]))):
        s, epoch, shard = key
        if len(fps[key]) > 1:
            detail = ", ".join(f"{fp} by pids {sorted(set(p))}" for fp, p in fps[key].items())
            where = ("" if epoch is None else f" in epoch {epoch}") + ("" if shard is None else f", shard {shard}")
            problems.append(f"replicas differ after committed step {s}{where}: {detail}")
    committed = {int(e["step"]) for e in events if e["kind"] == "commit"}
    missing = [s for s in range(1, (steps if complete else max(committed, default=0)) + 1) if s not in committed]
    if missing:
        problems.append(f"steps never committed by anyone: {_ranges(missing)} (final step {steps} not reached)"
                        if steps in missing else f"steps never committed by anyone: {_ranges(missing)}")
    for e in events:
        if e["kind"] == "diverged":
            problems.append(f"pid {e['pid']}: ReplicaDivergenceError at step {e.get('step')} (ranks "
                            f"{e.get('ranks')} differ: {e.get('groups')})")
    if not complete:
        return problems
    finals = [e for e in events if e["kind"] == "final"]
    if not finals:
        problems.append("no worker reached the final step")
    by_shard: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in finals:
        by_shard[e.get("shard")].append(e)
    for shard, group in sorted(by_shard.items(), key=lambda kv: str(kv[0])):
        if len({e["hash"] for e in group}) > 1:
            what = "live replicas differ at the end" + ("" if shard is None else f" (shard {shard})")
            problems.append(what + ": " + ", ".join(f"pid {e['pid']}: {e['hash'][:12]}" for e in group))
    if any(int(e["step"]) != steps for e in finals):
        problems.append(f"a worker ended at a step other than {steps}: "
                        + ", ".join(f"pid {e['pid']}: {e['step']}" for e in finals))
    return problems


def check_fencing(events: list[dict[str, Any]], chain: Optional[dict[int, list[str]]] = None,
                  store_restarted: bool = False) -> list[str]:
    """Invariant 3. ``chain``: epoch -> member ids of that configuration (None: not read).
    ``store_restarted``: after a store restart members re-join under their ids by design and
    one may be admitted an epoch after the others re-formed; then out-and-back is allowed
    (its steps are still checked by :func:`check_commits` and :func:`check_lineage`)."""
    problems: list[str] = []
    owner: dict[str, int] = {}
    for pid, evs in by_pid(events).items():
        fenced: set[str] = set()
        for e in evs:
            mid = e.get("member")
            if e["kind"] == "fenced" and mid:
                fenced.add(mid)
            elif e["kind"] == "commit" and mid in fenced:
                problems.append(f"pid {pid} committed step {e['step']} as member {mid} after that member was "
                                "fenced")
            if e["kind"] in ("commit", "admitted") and mid:
                if owner.setdefault(mid, pid) != pid:
                    problems.append(f"member id {mid} used by two processes: {owner[mid]} and {pid}")
    if chain:
        # A member seen (by its own events) in epochs a and c must be in every known epoch between:
        # out and back in under the same id means it was never fenced.
        epoch_of = uuid_epochs(events)
        mine: dict[str, set[int]] = defaultdict(set)
        for e in events:
            if e["kind"] == "reconfigured" and e.get("member"):
                mine[e["member"]].add(int(e["epoch"]))
            elif e["kind"] == "commit" and e.get("member") and e.get("uuid") is not None \
                    and int(e["uuid"]) in epoch_of:
                mine[e["member"]].add(epoch_of[int(e["uuid"])])
        for mid, eps in mine.items():
            lo, hi = min(eps), max(eps)
            out = [b for b in sorted(chain) if lo < b < hi and mid not in chain[b]]
            # Legitimate: after a store restart a member rejoins under its id and is admitted like
            # a joiner; then it received the state after it was out.
            readmitted = out and any(e["kind"] == "recovered" and e.get("member") == mid
                                     and int(e.get("epoch_now", 0)) > out[0] for e in events)
            if out and not readmitted and not store_restarted:
                problems.append(f"member {mid} was in epoch {lo}, not in epoch {out[0]}, and in epoch {hi} again, "
                                "never fenced (invariant 3)")
        epochs = sorted(chain)
        seen: dict[str, int] = {}  # member -> last epoch it was in
        for ep in epochs:
            for mid in chain[ep]:
                last = seen.get(mid)
                if last is not None and last != ep - 1 and all(e in chain for e in range(last + 1, ep)):
                    problems.append(f"member {mid} was removed after epoch {last} and is back at epoch {ep}")
                seen[mid] = ep
        for e in events:
            if e["kind"] != "commit":
                continue
            ep = epoch_of.get(int(e["uuid"])) if e.get("uuid") is not None else e.get("epoch")
            if ep in chain and e.get("member") not in chain[ep]:
                problems.append(f"pid {e['pid']} committed step {e['step']} as member {e.get('member')}, which is "
                                f"not in the configuration of epoch {ep}")
    return problems


def condense(problems: list[str], per_kind: int = 3) -> list[str]:
    """At most ``per_kind`` problems that start alike (one broken step breaks every later one too),
    plus how many more there were: a report a human reads."""
    out: list[str] = []
    counts: dict[str, int] = defaultdict(int)
    for p in problems:
        key = " ".join(p.split()[:3])
        counts[key] += 1
        if counts[key] <= per_kind:
            out.append(p)
    out += [f"... and {n - per_kind} more like {k!r}" for k, n in counts.items() if n > per_kind]
    return out


def check_guards(events: list[dict[str, Any]]) -> list[str]:
    """Invariant 2, from the job's own guard checks: every ``guard_violation`` is a problem."""
    return [f"pid {e['pid']}: guard {e.get('op')} of step {e.get('step')} (configuration {e.get('uuid')}): "
            f"{e.get('error')} (invariant 2)" for e in events if e["kind"] == "guard_violation"]


def coverage(events: list[dict[str, Any]]) -> dict[str, int]:
    """What the trial exercised (so a clean trial can be told from one where nothing happened):
    states received, members fenced, fenced processes that committed again as a new member,
    suicides in the vote or while sending state, steps not committed; for invariant 2, guard
    tensors snapshotted after an abort returned (``guard_snapshots``), guard ops pending at an
    abort whose wait raised (``guard_waits_raised``) and snapshot comparisons made later
    (``guard_checks``)."""
    out = {"recovered": 0, "fenced": 0, "rejoined_and_committed": 0, "suicides": 0, "aborted_steps": 0,
           "guard_snapshots": 0, "guard_waits_raised": 0, "guard_checks": 0}
    for evs in by_pid(events).values():
        fenced = False
        counted = False
        for e in evs:
            k = e["kind"]
            if k == "recovered" and int(e.get("step", 0)) > 0:
                out["recovered"] += 1
            elif k == "fenced":
                out["fenced"] += 1
                fenced = True
            elif k == "commit" and fenced and not counted:
                out["rejoined_and_committed"] += 1
                counted = True
            elif k == "suicide":
                out["suicides"] += 1
            elif k == "aborted":
                out["aborted_steps"] += 1
            elif k == "guard_abort":
                out["guard_snapshots"] += int(e.get("snapshots", 0))
                out["guard_waits_raised"] += int(e.get("raised", 0))
            elif k == "guard_check":
                out["guard_checks"] += int(e.get("checked", 0))
    return out


def uuid_epochs(events: list[dict[str, Any]]) -> dict[int, int]:
    """Configuration uuid -> epoch, from the Manager's ``reconfigured`` events (exact: the
    configuration the group was switched to)."""
    return {int(e["uuid"]): int(e["epoch"]) for e in events if e["kind"] == "reconfigured" and e.get("uuid")}


def check_lineage(events: list[dict[str, Any]], deaths: Optional[dict[int, float]] = None) -> list[str]:
    """One lineage of committed steps (invariant 1 across configurations): the steps committed
    in a configuration never go below a step already committed in an earlier configuration
    and still held by a live process. Two groups that each train on (a split brain) commit
    the same steps in different configurations, and if they compute alike, every fingerprint
    still agrees: this is what catches them. The configuration of a commit is its ``uuid``
    (not the member's newest epoch, which the watcher may have adopted before the group
    switched).

    A step whose every holder died (it committed there and nowhere else, e.g. the others
    failed the step, and then it died sending that state) is gone with them: the job
    rightly goes on from the newest state left, and commits those steps again. Holders are
    the processes that committed a step or received a state, and one is dead from its
    ``suicide`` event or ``deaths`` (pid -> time of a SIGKILL the schedule sent)."""
    epoch_of = uuid_epochs(events)
    dead = {int(e["pid"]): float(e["t"]) for e in events if e["kind"] == "suicide"}
    dead.update(deaths or {})
    commits: list[tuple[int, int, int, float]] = []  # (epoch, step, pid, t)
    for e in events:
        if e["kind"] == "commit" and e.get("uuid") is not None and int(e["uuid"]) in epoch_of:
            commits.append((epoch_of[int(e["uuid"])], int(e["step"]), int(e["pid"]), float(e["t"])))
    received = [(int(e["step"]), int(e["pid"]), float(e["t"])) for e in events
                if e["kind"] == "recovered" and e.get("step") is not None]
    problems: list[str] = []
    for ep in sorted({c[0] for c in commits}):
        mine = [c for c in commits if c[0] == ep]
        low, high = min(c[1] for c in mine), max(c[1] for c in mine)
        t0 = min(c[3] for c in mine)
        alive = lambda pid: dead.get(pid, float("inf")) > t0  # noqa: E731
        held = [(c[1], c[0]) for c in commits if c[0] < ep and alive(c[2])]
        held += [(step, ep) for step, pid, t in received if t < t0 and alive(pid) and step >= low]
        top = max(held, default=None)
        if top is not None and low <= top[0]:
            problems.append(f"two lineages: epoch {ep} committed steps {low}-{high} after epoch {top[1]} had "
                            f"committed up to step {top[0]} (a group trained on apart from the others)")
    return problems


def check_one_history(events: list[dict[str, Any]]) -> list[str]:
    """Invariant 8: every step is committed in one configuration (epoch) only. The one
    exception is the rollback of invariant 1: a step whose vote completed on some ranks and
    failed on others of epoch ``A`` (an ``aborted_step`` of that step in ``A``) may be redone
    in a later configuration when its committers were left out or died: its commit in ``A``
    was never the job's. Any other step committed in two epochs is a second history, whether
    its fingerprints match or not."""
    epochs: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))  # step -> epoch -> pids
    for e in events:
        if e["kind"] == "commit" and e.get("commit_epoch") is not None:
            epochs[int(e["step"])][int(e["commit_epoch"])].add(int(e["pid"]))
        elif e["kind"] == "rolled_forward" and e.get("epoch") is not None:
            epochs[int(e["step"])][int(e["epoch"])].add(int(e["pid"]))
    # an aborted_step event names the step count before the failed step: the commit would have been step + 1
    partial = {(int(e["step"]) + 1, int(e["epoch"])) for e in events
               if e["kind"] == "aborted_step" and e.get("epoch") is not None}
    problems = []
    for step, by_epoch in sorted(epochs.items()):
        newest = max(by_epoch)
        redone = sorted(ep for ep in by_epoch if ep != newest and (step, ep) not in partial)
        if redone:
            where = "; ".join(f"epoch {ep} by pids {sorted(by_epoch[ep])}" for ep in sorted(by_epoch))
            problems.append(f"step {step} was committed in {len(by_epoch)} configurations ({where}): a second "
                            "history (the job trained again from an older state)")
    return problems


def check_state_lost(events: list[dict[str, Any]], rc: Optional[int], lost_at: float) -> list[str]:
    """After every holder of the job's newest state was killed at ``lost_at`` (a ``stale``
    fault), the job must stop: workers raise StateLostError and the launcher exits with
    ``EXIT_STOP_JOB``, instead of completing from an older state."""
    from ftc10d.launch import EXIT_STOP_JOB

    problems = []
    if rc == 0:
        problems.append("the job completed after every holder of its newest state was killed: it trained on from "
                        "an older state")
    elif rc != EXIT_STOP_JOB:
        problems.append(f"after every holder of its newest state was killed the launcher exited {rc}, not "
                        f"{EXIT_STOP_JOB} (a worker's StateLostError stops the job)")
    if not any(e["kind"] == "state_lost_exit" and float(e["t"]) >= lost_at for e in events):
        problems.append("no worker raised StateLostError after every holder of the job's newest state was killed")
    return problems


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


# ------------------------------------------------------------------ stalls


def commit_times(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, step) of the job's commits: the first time any worker committed each step."""
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "commit":
            first[e["step"]] = min(first.get(e["step"], e["t"]), e["t"])
    return sorted((t, s) for s, t in first.items())


def longest_pause_at(times: list[tuple[float, int]]) -> tuple[int, int]:
    """The steps (before, after) around the job's longest pause; (-1, -1) with < 2 commits."""
    pairs = list(zip(times, times[1:]))
    if not pairs:
        return (-1, -1)
    (_, a), (_, b) = max(pairs, key=lambda p: p[1][0] - p[0][0])
    return (a, b)


def longest_pause(times: list[tuple[float, int]]) -> Optional[float]:
    """The job's longest interval between two consecutive commits, whatever its cause: the
    pause a user feels, which a per-fault window can miss (a rejoin long after its fault)."""
    gaps = [b - a for (a, _), (b, _) in zip(times, times[1:])]
    return round(max(gaps), 4) if gaps else None


#: The pause any single fault may cause beyond detection, on this class of machine: one
#: rendezvous and a redone step, then a replacement's admission with its state transfer
#: (they can fall into the same gap), with room for a loaded 2-core machine.
PAUSE_ALLOWANCE_S = 2.0


def pause_bound(spec: Any) -> float:
    """The longest pause between two commits a trial may show: two heartbeat timeouts (a
    failure's detection, and the removal of a second member a double fault or a freeze
    can add) plus :data:`PAUSE_ALLOWANCE_S`; a fault that takes the membership store
    away adds its downtime and a heartbeat timeout for the members to re-form. A 5-s or
    30-s stall inside any reconfigure -- a join, a rejoin, a store restart -- exceeds
    it: the pause a user feels, whatever its cause (issue 14)."""
    hb = float(spec.heartbeat_timeout)
    extra = 0.0
    for f in spec.faults:
        if f.kind in ("store", "etcd", "store_stop"):
            extra = max(extra, float(f.duration or 0.0) + hb)
    return round(2 * hb + PAUSE_ALLOWANCE_S + extra, 3)


def stall_after(times: list[tuple[float, int]], t_fault: float, until: float) -> Optional[float]:
    """The longest time without a job commit from ``t_fault`` to the first commit after
    ``until`` (the end of the fault's window: resume or heal time plus a margin, which
    takes in a replacement's admission). None if the job never committed after the fault."""
    ts = [t for t, _ in times if t > t_fault]
    if not ts:
        return None
    later = [t for t in ts if t > until]
    marks = [t_fault] + [t for t in ts if t <= until] + later[:1]
    return max(b - a for a, b in zip(marks, marks[1:]))


# ------------------------------------------------------------------ leaks


def _stat(pid: str) -> Optional[tuple[str, int]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rpartition(")")[2].split()
        return rest[0], int(rest[2])  # state, pgrp
    except (OSError, IndexError, ValueError):
        return None


def leftover_processes(pids: set[int]) -> list[int]:
    """Live (non-zombie) processes that are one of ``pids`` or in one of their process groups
    (every launcher child leads its own group, so whatever a worker started is in it)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(name)
        if st is None or st[0] == "Z":
            continue
        if int(name) in pids or st[1] in pids:
            out.append(int(name))
    return sorted(out)


def wait_no_leftovers(pids: set[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = leftover_processes(pids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def leaked_shm(before: set[str], pids: set[int]) -> tuple[list[str], list[str]]:
    """(leaked, unattributed): new ``/dev/shm`` entries naming one of the trial's pids (as
    torch's ``torch_<pid>_...`` segments do) are leaks; other new entries are only reported,
    because the machine is shared (other jobs' tests make and remove their own)."""
    new = sorted(shm_entries() - before)
    tokens = {n: set(n.replace("-", "_").replace(".", "_").split("_")) for n in new}
    ours = [n for n in new if any(str(p) in tokens[n] for p in pids)]
    return ours, [n for n in new if n not in ours]


def _listening() -> list[tuple[int, str]]:
    """(port, socket inode) of every TCP socket in LISTEN state in this network namespace."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A":
                        out.append((int(parts[1].rpartition(":")[2], 16), parts[9]))
        except (OSError, StopIteration):
            continue
    return out


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state in this network namespace (IPv4 and IPv6)."""
    return {port for port, _ in _listening()}


def listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on ``port`` in this network namespace."""
    return {inode for p, inode in _listening() if p == port}


def _sockets_of(pid: str, inodes: set[str]) -> int:
    """How many of ``inodes`` process ``pid`` holds open (0 if its fds cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    count = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            count += 1
    return count


def listening_owners(port: int) -> dict[int, str]:
    """pid -> command line of every process holding a socket that listens on ``port`` in
    this network namespace (empty if none, or if their /proc entries cannot be read)."""
    inodes = listening_inodes(port)
    owners: dict[int, str] = {}
    if not inodes:
        return owners
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if _sockets_of(pid, inodes):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    owners[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
            except OSError:
                owners[int(pid)] = "?"
    return owners


def own_listening_sockets() -> int:
    """How many listening TCP sockets this process holds (the chaos runner outlives trials)."""
    return _sockets_of("self", {inode for _, inode in _listening()})

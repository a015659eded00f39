"""Fault schedules: what a chaos trial injects, drawn from a seeded RNG, replayable.

A schedule is data, not code: a list of :class:`Fault` that serializes to JSON and
back unchanged, so that a failed trial's record *is* its reproducer (``ftc10d chaos
--replay trial.json`` runs the same schedule on the same job). Everything random
about a trial (kinds, slots, steps, durations) is drawn here from one
``random.Random(seed)``; only the machine's timing is not replayed.

Kinds (``KINDS``), with ``hb`` the heartbeat timeout:

- ``kill``        SIGKILL the worker of ``slot`` once the job committed ``at_step``;
- ``stop_short``  SIGSTOP, SIGCONT after ``duration`` < hb (nobody is removed);
- ``stop_long``   SIGSTOP, SIGCONT after ``duration`` > hb (removed, fenced, rejoins);
- ``slow``        a SIGSTOP/SIGCONT duty cycle for ``duration`` (each pause < hb):
                  a rank that computes at a fraction of the others' speed;
- ``double``      two faults at once: SIGKILL ``slot``, and 0-30 ms later ``kind2``
                  (``kill`` or ``stop_long``) on ``slot2``;
- ``die_vote``    the worker of ``slot`` SIGKILLs itself inside the commit vote of the
                  first step after ``at_step`` (the job's ``die`` option);
- ``die_after_vote`` the worker of ``slot`` SIGKILLs itself as soon as its own commit-vote
                  all-reduce of the first step after ``at_step`` completed: the others may be
                  half way through that step's last collectives (the vote, a gradient bucket
                  still in flight on Gloo's other thread), so some complete and some fail;
- ``die_send``    ``slot`` is SIGKILLed at ``at_step``; the survivor that then starts
                  sending the state to the replacement SIGKILLs itself as it sends;
- ``stale``       the newest state lost while an older one lives on (invariant 8): ``slot`` is
                  SIGSTOPped (past hb: removed); once the others committed :data:`STALE_GAP`
                  steps without it, every worker holding their newer state is SIGKILLed at
                  once (every other slot; ``--mesh``: every slot outside its replica), and it
                  gets SIGCONT ``duration`` later (before or after the replacements arrive). The
                  job must not train on from its older state: every worker raises
                  ``StateLostError`` after ``sync_timeout`` and the job stops (launcher exit 86);
                  nothing is committed twice. It ends the trial: nothing is drawn after it;
- ``node``        (``--mesh`` only) every worker of replica ``slot`` is SIGKILLed at once: a
                  node lost with all its ranks; the other replicas train on, the
                  replacements receive their shards from them;
- ``partition``   the network link of host ``slot`` (``--hosts`` > 1, root) is cut for
                  ``duration`` > hb, then restored;
- ``store``       the coordinator store (``ftc10d coordinator``, a process of its own in
                  trials that have this fault) is SIGKILLed and restarted on the same port
                  ``duration`` later, with none of its state: members re-form;
- ``store_stop``  the coordinator store process is SIGSTOPped for ``duration`` (0.3-3 s, up to
                  four heartbeat timeouts), then SIGCONTed: every store call of the members
                  blocks meanwhile (torch's TCPStore client has no timeout on a stopped
                  server), nobody can beat; on resume nobody may be removed for the silence
                  and the job goes on. Opt-in (weight 0 unless ``--weight store_stop=N``), so
                  that the seeds of earlier runs still draw the trials they drew;
- ``etcd``        (``--membership etcd`` only) etcd member ``slot`` of the trial's three is
                  SIGKILLed and restarted ``duration`` (0.5-3 s) later on its own data dir,
                  so it rejoins the cluster; the other two keep the quorum, the job trains on
                  (the trial holds it back while another member is not healthy again).

``TrialSpec.membership`` says where the job's membership lives: ``tcp`` (the coordinator
store, the default) or ``etcd`` (a 3-member cluster on loopback that each trial starts).
The ``store`` fault (the coordinator TCPStore) is drawn only with ``tcp``, ``etcd`` only with etcd.

``TrialSpec.mesh`` (``[R, S]``, ``ftc10d chaos --mesh RxS``) runs the job as FT-HSDP: FSDP2
over each replica's S ranks, R fault-tolerant replicas, slot ``k`` at ``divmod(k, S)``. A
schedule then never takes every replica of one shard index at once (that loses state by
design: the job raises ``StateLostError``, tested on its own): a ``double``'s two slots hold
different shard indices, ``node`` takes one replica, and ``die_send`` (the only other holder
of a shard dies as it sends it) needs R >= 3. The trial injects a fault only once every slot's
worker has committed a step (the mesh is whole: the last fault's replacements hold their shards).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from ftc10d.types import InvalidOptionError

KINDS = ("kill", "stop_short", "stop_long", "slow", "double", "die_vote", "die_after_vote", "die_send", "partition",
         "store", "etcd", "node", "stale", "store_stop")
#: Kinds drawn only when given a weight (``--weight KIND=N``): added after runs whose seeds are on record.
OPT_IN = ("store_stop",)
#: Kinds that need the coordinator store as a process of its own (``TrialSpec.membership`` tcp).
STORE_KINDS = ("store", "store_stop")
#: ``stale``: steps the others commit without the frozen worker before its newer state's holders are killed.
STALE_GAP = 5
#: Kinds armed in the job at launch (its ``die`` option): at most one of each per trial.
ARMED = ("die_vote", "die_after_vote", "die_send")
#: Where a trial's membership lives: the coordinator TCPStore, or a 3-member etcd cluster.
MEMBERSHIPS = ("tcp", "etcd")
#: Members of a trial's etcd cluster (one may be down: the other two are a quorum).
ETCD_MEMBERS = 3
#: Kinds a ``double`` combines.
DOUBLE_PARTS = ("kill", "stop_long")
#: Job steps before the first fault (warm-up) and after the last one (time to recover and finish).
FIRST_FAULT_STEP = 8
TAIL_STEPS = 15


class ScheduleError(InvalidOptionError):
    """A schedule (or a replay file) that cannot be run; the message says what is wrong."""


@dataclass(frozen=True)
class Fault:
    """One fault of a trial. ``slot`` is a launcher slot (a host index for ``partition``)."""

    kind: str
    slot: int
    at_step: int
    duration: Optional[float] = None
    slot2: Optional[int] = None
    kind2: Optional[str] = None
    gap_s: float = 0.0  # double: delay between the two faults

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "gap_s" and v == 0.0)}

    @classmethod
    def from_json(cls, obj: Any) -> "Fault":
        if not isinstance(obj, dict):
            raise ScheduleError(f"a fault must be a JSON object, got {obj!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ScheduleError(f"fault {obj!r}: unknown fields {unknown}")
        try:
            fault = cls(**obj)
        except TypeError as exc:
            raise ScheduleError(f"fault {obj!r}: {exc}") from None
        if fault.kind not in KINDS:
            raise ScheduleError(f"fault {obj!r}: unknown kind {fault.kind!r}; kinds: {', '.join(KINDS)}")
        return fault

    def __str__(self) -> str:
        dur = f" for {self.duration:.2f} s" if self.duration is not None else ""
        if self.kind == "double":
            return (f"double@{self.at_step}: kill slot {self.slot} + {self.kind2} slot {self.slot2} "
                    f"{self.gap_s * 1000:.0f} ms later{dur}")
        where = f"host {self.slot}" if self.kind == "partition" else "coordinator" if self.kind in STORE_KINDS \
            else f"etcd member {self.slot}" if self.kind == "etcd" else f"replica {self.slot}" \
            if self.kind == "node" else f"slot {self.slot}"
        return f"{self.kind}@{self.at_step} {where}{dur}"

@dataclass
class TrialSpec:
    """Everything that defines one trial (what ``--replay`` reads back)."""

    seed: int
    faults: list[Fault]
    world_size: int = 4
    steps: int = 150
    heartbeat_timeout: float = 0.75
    hosts: int = 1
    spares: int = 1
    interval: float = 0.03
    timeout: float = 120.0
    membership: str = "tcp"
    #: FT-HSDP: ``[replicas, shard_size]`` (``world_size`` is their product); None: DDP.
    mesh: Optional[list[int]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["faults"] = [f.to_json() for f in self.faults]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "TrialSpec":
        if isinstance(obj, dict) and "spec" in obj:  # a whole trial record (trials/<n>.json)
            obj = obj["spec"]
        if not isinstance(obj, dict) or "seed" not in obj or "faults" not in obj:
            raise ScheduleError("a replay file holds a trial record or its 'spec': {seed, faults, ...}")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in obj.items() if k in known}
        kwargs["faults"] = [Fault.from_json(f) for f in obj["faults"]]
        if kwargs.get("mesh") is not None:
            kwargs["mesh"] = list(kwargs["mesh"])
        spec = cls(**kwargs)
        validate(spec)
        return spec

    def describe(self) -> str:
        return "; ".join(str(f) for f in self.faults) or "no faults"


def validate(spec: TrialSpec) -> None:
    """Raise ScheduleError unless every fault fits the job (slots, steps, hosts)."""
    if spec.mesh is not None:
        _validate_mesh(spec)
    elif spec.world_size < 3:
        raise ScheduleError("a chaos trial needs at least 3 workers (a removal must leave a majority)")
    if spec.steps < FIRST_FAULT_STEP + TAIL_STEPS:
        raise ScheduleError(f"a chaos trial needs at least {FIRST_FAULT_STEP + TAIL_STEPS} steps")
    if spec.membership not in MEMBERSHIPS:
        raise ScheduleError(f"membership {spec.membership!r} is not one of {', '.join(MEMBERSHIPS)}")
    if spec.membership == "etcd" and spec.hosts > 1:
        raise ScheduleError("--membership etcd runs its etcd cluster on the root namespace's loopback, which other "
                            "hosts cannot reach: use --hosts 1 with it")
    for f in spec.faults:
        limit = spec.hosts if f.kind == "partition" else 1 if f.kind in STORE_KINDS \
            else ETCD_MEMBERS if f.kind == "etcd" else spec.mesh[0] if f.kind == "node" and spec.mesh \
            else spec.world_size
        if f.kind == "node" and spec.mesh is None:
            raise ScheduleError(f"{f}: a node fault takes a whole replica of an FT-HSDP job (--mesh RxS)")
        if f.kind in STORE_KINDS and spec.membership != "tcp":
            raise ScheduleError(f"{f}: a store fault takes the coordinator store (--membership tcp)")
        if f.kind == "etcd" and spec.membership != "etcd":
            raise ScheduleError(f"{f}: an etcd fault needs the trial's membership in etcd (--membership etcd)")
        if not 0 <= f.slot < limit:
            raise ScheduleError(f"{f}: slot {f.slot} is not in [0, {limit})")
        if f.kind == "partition" and (spec.hosts < 2 or f.slot == 0):
            raise ScheduleError(f"{f}: a partition cuts host 1..{spec.hosts - 1} (--hosts > 1); host 0 hosts "
                                "the coordinator")
        if not 1 <= f.at_step < spec.steps:
            raise ScheduleError(f"{f}: step {f.at_step} is not in [1, {spec.steps})")
        if f.kind == "double":
            if (f.slot2 is None or f.kind2 not in DOUBLE_PARTS or f.slot2 == f.slot
                    or not 0 <= f.slot2 < spec.world_size):
                raise ScheduleError(f"{f}: a double needs slot2 != slot and kind2 in {DOUBLE_PARTS}")
        timed = ("stop_short", "stop_long", "slow", "partition", "store", "etcd", "stale", "store_stop")
        if f.kind in timed and (f.duration is None or f.duration <= 0):
            raise ScheduleError(f"{f}: needs a positive duration")


def _validate_mesh(spec: TrialSpec) -> None:
    """A ``--mesh`` trial: the mesh fits, and no fault takes every replica of a shard index."""
    mesh = spec.mesh or []
    if len(mesh) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh):
        raise ScheduleError(f"mesh {mesh!r}: give [replicas, shard_size], two whole numbers >= 1")
    replicas, shard_size = mesh
    if replicas < 2:
        raise ScheduleError(f"mesh {replicas}x{shard_size}: a chaos trial needs at least 2 replicas (with one, "
                            "any lost rank loses its shard: StateLostError, by design)")
    if spec.world_size != replicas * shard_size:
        raise ScheduleError(f"mesh {replicas}x{shard_size} has {replicas * shard_size} workers, not "
                            f"world_size={spec.world_size}")
    if spec.hosts != 1:
        raise ScheduleError("--mesh runs on one host (its node fault is the whole-replica loss)")
    for f in spec.faults:
        if f.kind == "die_send" and replicas < 3:
            raise ScheduleError(f"{f}: with {replicas} replicas the rank that sends a shard is its only other "
                                "holder; killing it loses the shard by design (needs a mesh of 3 or more replicas)")
        if f.kind == "double" and f.slot2 is not None and shard_size > 1 and replicas < 3 \
                and f.slot % shard_size == f.slot2 % shard_size:
            raise ScheduleError(f"{f}: slots {f.slot} and {f.slot2} hold the same shard index in a mesh of "
                                f"{replicas} replicas: both gone loses that shard by design")


def mesh_kinds(replicas: int, membership: str = "tcp") -> tuple[str, ...]:
    """The kinds a ``--mesh`` trial draws: no partition (one host), ``node``, and ``die_send``
    only with a third replica to send the shard after the first sender died."""
    return tuple(k for k in KINDS if k != "partition" and (k != "die_send" or replicas >= 3)
                 and (k not in STORE_KINDS or membership == "tcp") and (k != "etcd" or membership == "etcd"))


def hosts_of(world_size: int, hosts: int) -> list[int]:
    """Slot -> host: hosts 1..H-1 get one worker each, host 0 (the coordinator's) the rest,
    so that cutting any one host off leaves a strict majority on host 0's side."""
    if hosts < 1 or world_size - (hosts - 1) <= world_size // 2:
        raise ScheduleError(f"--hosts {hosts} with {world_size} workers: a cut-off host must be a minority; "
                            f"use at most {(world_size + 1) // 2} hosts")
    return [0] * (world_size - (hosts - 1)) + list(range(1, hosts))


def draw_fault(rng: random.Random, kind: str, at_step: int, world_size: int, hb: float, hosts: int,
               mesh: Optional[list[int]] = None) -> Fault:
    """One fault of ``kind`` at ``at_step``, with its slot(s) and duration drawn from ``rng``
    (``mesh``: a double's second slot holds another shard index when there are two replicas)."""
    slot = rng.randrange(world_size)
    if kind == "node":
        assert mesh is not None
        return Fault(kind, rng.randrange(mesh[0]), at_step)
    if kind == "stale":  # resumed 0.2 s (before the replacements) to 6 s (after them) after the kill
        return Fault(kind, slot, at_step, round(rng.uniform(0.2, 6.0), 3))
    if kind == "stop_short":
        return Fault(kind, slot, at_step, round(rng.uniform(0.2, 0.6) * hb, 3))
    if kind == "stop_long":
        return Fault(kind, slot, at_step, round(rng.uniform(2.0, 3.5) * hb, 3))
    if kind == "slow":
        return Fault(kind, slot, at_step, round(rng.uniform(1.5, 3.0), 3))
    if kind == "double":
        shard_size = mesh[1] if mesh is not None and mesh[0] < 3 and mesh[1] > 1 else None
        slot2 = rng.choice([s for s in range(world_size)
                            if s != slot and (shard_size is None or s % shard_size != slot % shard_size)])
        kind2 = rng.choice(DOUBLE_PARTS)
        duration = round(rng.uniform(2.0, 3.0) * hb, 3) if kind2 == "stop_long" else None
        return Fault(kind, slot, at_step, duration, slot2=slot2, kind2=kind2, gap_s=round(rng.uniform(0, 0.03), 4))
    if kind == "partition":
        return Fault(kind, rng.randrange(1, hosts), at_step, round(rng.uniform(2.0, 3.5) * hb, 3))
    if kind == "store":
        return Fault(kind, 0, at_step, round(rng.uniform(0.3, 1.5), 3))
    if kind == "store_stop":
        return Fault(kind, 0, at_step, round(rng.uniform(0.3, 3.0), 3))
    if kind == "etcd":
        return Fault(kind, rng.randrange(ETCD_MEMBERS), at_step, round(rng.uniform(0.5, 3.0), 3))
    return Fault(kind, slot, at_step)


def available_kinds(hosts: int, partition_ok: bool, membership: str = "tcp") -> tuple[str, ...]:
    """The kinds a trial can draw: ``partition`` with several hosts, ``store`` (the coordinator
    TCPStore holding the membership) with ``tcp``, ``etcd`` (one of three members) with ``etcd``."""
    return tuple(k for k in KINDS if (k != "partition" or (hosts > 1 and partition_ok)) and k != "node"
                 and (k not in STORE_KINDS or membership == "tcp") and (k != "etcd" or membership == "etcd"))


def draw(seed: int, *, world_size: int = 4, steps: int = 150, heartbeat_timeout: float = 0.75, hosts: int = 1,
         kinds: Optional[tuple[str, ...]] = None, max_faults: int = 2, membership: str = "tcp",
         weights: Optional[dict[str, int]] = None, mesh: Optional[list[int]] = None, **spec_kwargs: Any) -> TrialSpec:
    """The trial of ``seed``: 1..``max_faults`` faults at steps far enough apart that the job
    recovers from one before the next (a ``double`` is the at-once case). ``weights``: kind ->
    how many times more often than the others it is drawn (default 1 each; 0 never)."""
    rng = random.Random(seed)
    if mesh is not None:
        world_size = mesh[0] * mesh[1]
    if not kinds:
        kinds = mesh_kinds(mesh[0], membership) if mesh is not None else available_kinds(hosts, False, membership)
    weights = weights or {}
    unknown = sorted(set(weights) - set(KINDS))
    if unknown or any(not isinstance(w, int) or w < 0 for w in weights.values()):
        raise ScheduleError(f"weights {weights}: kinds must be among {', '.join(KINDS)} and weights integers >= 0")
    pool = tuple(k for k in kinds for _ in range(weights.get(k, 0 if k in OPT_IN else 1)))
    if not pool:
        raise ScheduleError(f"weights {weights} leave no kind to draw among {', '.join(kinds)}")
    count = rng.randint(1, max_faults)
    last = steps - TAIL_STEPS
    span = max((last - FIRST_FAULT_STEP) // count, 1)
    faults = []
    for i in range(count):
        lo = FIRST_FAULT_STEP + i * span
        at = rng.randint(lo, max(lo, lo + span - 6))
        faults.append(draw_fault(rng, rng.choice(pool), at, world_size, heartbeat_timeout, hosts, mesh))
    # A stale fault ends the job (its state is lost on purpose): nothing after it.
    stale = next((i for i, f in enumerate(faults) if f.kind == "stale"), None)
    faults = faults if stale is None else faults[:stale + 1]
    # die_* arm the job at launch: at most one of each per trial, and one per slot.
    seen: set[Any] = set()
    faults = [f for f in faults if f.kind not in ARMED or not (
        f.kind in seen or (f.kind != "die_send" and f.slot in seen) or seen.update({f.kind, f.slot}))]
    spec = TrialSpec(seed, faults, world_size=world_size, steps=steps, heartbeat_timeout=heartbeat_timeout,
                     hosts=hosts, membership=membership, mesh=list(mesh) if mesh is not None else None, **spec_kwargs)
    validate(spec)
    return spec


def trial_seeds(seed: int, n: int) -> list[int]:
    """The seeds of a run's trials: a run of N trials with seed S is N trials of fixed seeds."""
    rng = random.Random(seed)
    return [rng.getrandbits(31) for _ in range(n)]


def load_replay(path: str) -> TrialSpec:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as exc:
        raise ScheduleError(f"cannot read replay file {path!r}: {exc}") from None
    return TrialSpec.from_json(obj)

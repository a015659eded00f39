"""The ``ftc10d`` command line: ``ftc10d demo | example | launch | bench | coordinator | version`` (trace
and bench come with their layers).

Each subcommand is one function decorated with :func:`subcommand`, which
declares its arguments next to it; adding a subcommand touches nothing else.
A subcommand returns the process exit code. Heavy imports happen inside the
subcommand, so ``ftc10d --help`` stays cheap for the layers that add their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence

Handler = Callable[[argparse.Namespace], int]


class _Arg:
    """The arguments of one ``parser.add_argument`` call, kept for later."""

    def __init__(self, *flags: str, **kwargs: Any) -> None:
        self.flags = flags
        self.kwargs = kwargs


def arg(*flags: str, **kwargs: Any) -> _Arg:
    """Declare an argument of a subcommand (same signature as ``add_argument``)."""
    return _Arg(*flags, **kwargs)


_SUBCOMMANDS: list[tuple[str, str, tuple[_Arg, ...], Handler]] = []


def subcommand(name: str, help: str, *args: _Arg) -> Callable[[Handler], Handler]:
    """Register ``fn`` as ``ftc10d <name>``; its docstring becomes the description."""

    def register(fn: Handler) -> Handler:
        _SUBCOMMANDS.append((name, help, args, fn))
        return fn

    return register


# ================================================================ subcommands


@subcommand(
    "demo",
    "train a small model on 4 workers through ftc10d while ranks are killed, frozen and replaced; live view",
    arg("--out", default="demo-out", metavar="DIR",
        help="where report.json, timeline.png and the event files go (default: demo-out)"),
    arg("--world-size", type=int, default=None, metavar="N", help="number of workers (default: 4, or R*S with --mesh)"),
    arg("--mesh", default=None, metavar="RxS",
        help="FT-HSDP: R replicas of S ranks each, FSDP2 sharding inside each replica, the replicas fault tolerant "
             "(e.g. 2x2); default: DDP"),
    arg("--steps", type=int, default=300, metavar="N", help="training steps (default: 300)"),
    arg("--faults", default="kill:1@40,freeze:2@120:2.5", metavar="SCHEDULE",
        help="KIND:SLOT@STEP[:SECONDS], comma-separated; kinds: kill (SIGKILL; a warm spare replaces it), "
             "freeze (SIGSTOP, SIGCONT after SECONDS, default 2.5); 'none' for no faults "
             "(default: kill:1@40,freeze:2@120:2.5)"),
    arg("--heartbeat-timeout", type=float, default=1.0, metavar="SECONDS",
        help="a member whose heartbeat is silent this long is removed (default: 1)"),
    arg("--spares", type=int, default=1, metavar="N", help="warm spares kept ready (default: 1)"),
    arg("--timeout", type=float, default=180.0, metavar="SECONDS", help="bound of the whole run (default: 180)"),
    arg("--max-pause", type=float, default=None, metavar="SECONDS",
        help="bound of the job's longest pause between two committed steps, whatever its cause; the demo exits "
             "non-zero above it (default: heartbeat timeout + 1)"),
    arg("--no-live", dest="live", action="store_false", help="plain log lines instead of the live view"),
)
def demo(args: argparse.Namespace) -> int:
    """Launch WORLD_SIZE workers (and warm spares) training a ~0.5 M-parameter MLP on
    teacher data with DDP through ftc10d, inject the fault schedule, show progress
    live, then print a summary (stall per fault, steps lost, replicas identical) and
    write report.json and timeline.png into --out. Exits 0 only if the job completed,
    every live replica ended bitwise-identical and the job's longest pause between two
    commits stayed within --max-pause."""
    mesh = None
    if args.mesh is not None:
        from ftc10d.demo.faults import parse_mesh

        try:
            mesh = parse_mesh(args.mesh)
        except argparse.ArgumentTypeError as exc:
            args.parser.error(str(exc))
        if mesh[0] < 2:
            args.parser.error(f"--mesh {args.mesh}: at least 2 replicas (with one, any death loses a shard)")
        if args.world_size is not None and args.world_size != mesh[0] * mesh[1]:
            args.parser.error(f"--world-size {args.world_size} does not match --mesh {args.mesh} "
                              f"({mesh[0] * mesh[1]} workers); drop --world-size")
        args.world_size = mesh[0] * mesh[1]
    elif args.world_size is None:
        args.world_size = 4
    if args.world_size < 2:
        args.parser.error("--world-size must be at least 2")
    if args.steps < 2:
        args.parser.error("--steps must be at least 2")
    if args.heartbeat_timeout <= 0:
        args.parser.error("--heartbeat-timeout must be positive")
    if args.spares < 0:
        args.parser.error("--spares must be >= 0")
    if args.max_pause is not None and args.max_pause <= 0:
        args.parser.error("--max-pause must be positive")
    from ftc10d.demo.faults import FaultScheduleError, parse_schedule

    try:
        parse_schedule(args.faults, world_size=args.world_size, steps=args.steps)
    except FaultScheduleError as exc:
        args.parser.error(str(exc))
    from ftc10d.demo import driver  # imports torch: only once the arguments are good

    return driver.main(out=args.out, world_size=args.world_size, steps=args.steps, faults=args.faults,
                       heartbeat_timeout=args.heartbeat_timeout, live=args.live, spares=args.spares,
                       timeout=args.timeout, max_pause=args.max_pause, mesh=mesh)


@subcommand(
    "example",
    "run a small example of one layer: 'reconfigure' kills a rank of a raw ftc10d group and reconfigures it",
    arg("name", choices=["reconfigure"], help="which example"),
    arg("--world-size", type=int, default=4, metavar="N", help="number of ranks (default: 4)"),
    arg("--kill-rank", type=int, default=2, metavar="R", help="rank to SIGKILL (default: 2)"),
    arg("--steps", type=int, default=20, metavar="N",
        help="allreduce steps before the kill, and again after the reconfigure (default: 20)"),
    arg("--timeout", type=float, default=60.0, metavar="SECONDS",
        help="op and rendezvous timeout; also bounds the whole run (default: 60)"),
    arg("--no-live", dest="live", action="store_false",
        help="print the timeline once, sorted, at the end instead of as events arrive"),
)
def example(args: argparse.Namespace) -> int:
    """reconfigure: host a TCPStore, start the ranks (each an ftc10d.ProcessGroup over Gloo)
    allreducing in a loop, SIGKILL one of them, and show each survivor getting a
    typed PeerFailureError naming the dead rank, agreeing on the survivors,
    calling ftc10d.reconfigure with a fresh uuid and carrying on. Exits 0 only if
    every survivor finished with correct allreduce results."""
    if args.world_size < 2:
        args.parser.error("--world-size must be at least 2 (one rank is killed)")
    if not 0 <= args.kill_rank < args.world_size:
        args.parser.error(f"--kill-rank must be in [0, {args.world_size})")
    if args.steps < 1:
        args.parser.error("--steps must be at least 1")
    if args.timeout <= 0:
        args.parser.error("--timeout must be positive")
    from ftc10d.examples import reconfigure_after_kill  # imports torch: only once the arguments are good

    return reconfigure_after_kill.main(
        world_size=args.world_size,
        kill_rank=args.kill_rank,
        steps=args.steps,
        live=args.live,
        timeout_s=args.timeout,
        log_level=logging.INFO if args.verbose else None,
    )


@subcommand(
    "bench",
    "measure a scenario; 'recovery': the demo's job vs plain DDP (per-step cost) and vs a torchrun restart",
    arg("name", choices=["recovery"], help="which benchmark"),
    arg("--json", dest="as_json", action="store_true", help="print the results as JSON"),
    arg("--out", default="bench-out", metavar="DIR", help="where the runs' files go (default: bench-out)"),
    arg("--steps", type=int, default=300, metavar="N", help="steps per overhead run (default: 300)"),
    arg("--rounds", type=int, default=2, metavar="N",
        help="interleaved plain/ftc10d rounds for the overhead (default: 2)"),
)
def bench(args: argparse.Namespace) -> int:
    """recovery: (a) the demo's job with plain torch DDP (gloo, under torchrun) and through
    ftc10d, no faults, interleaved: median step time and their ratio; (b) a SIGKILL of one
    worker: ftc10d's survivors' first commit, stall and warm replacement (and a freeze),
    vs torchrun --max-restarts 1 (time from the kill to the first step after the restart).
    Takes a few minutes on 2 cores."""
    if args.steps < 100:
        args.parser.error("--steps must be at least 100 (the first 30 are warm-up)")
    if args.rounds < 1:
        args.parser.error("--rounds must be at least 1")
    from ftc10d.demo import bench as demo_bench

    return demo_bench.main(out=args.out, as_json=args.as_json, steps=args.steps, rounds=args.rounds)


@subcommand(
    "coordinator",
    "host the membership store (a TCPStore) and detect lapsed heartbeats",
    arg("--port", type=int, default=29400, metavar="N", help="TCP port to listen on (default: 29400; 0 picks one)"),
    arg("--host", default="127.0.0.1", metavar="ADDR",
        help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 for every interface)"),
    arg("--heartbeat-timeout", type=float, default=1.0, metavar="SECONDS",
        help="remove a member whose heartbeat is silent this long (default: 1)"),
    arg("--no-detect", dest="detect", action="store_false",
        help="only host the store; leave failure detection to the members"),
    arg("--prefix", default=None, metavar="KEY", help="key prefix of the membership records"),
)
def coordinator(args: argparse.Namespace) -> int:
    """Run a membership coordinator until SIGINT/SIGTERM: a torch TCPStore bound to
    --host (loopback unless told otherwise) that ranks use for membership (and may
    use for their ProcessGroup's rendezvous), plus a detector that watches every
    member's heartbeat. With $FTC10D_TOKEN set, membership records are HMAC-signed
    and records with a bad signature are ignored. Prints one line per agreed
    configuration. The store is in memory: if the coordinator restarts, members
    rejoin and re-form a configuration with a fresh uuid."""
    if args.port < 0 or args.port > 65535:
        args.parser.error("--port must be in [0, 65535]")
    if args.heartbeat_timeout <= 0:
        args.parser.error("--heartbeat-timeout must be positive")
    import signal
    import threading

    from ftc10d.membership import tcp

    kwargs = {} if args.prefix is None else {"prefix": args.prefix}
    co = tcp.Coordinator(args.host, args.port, detect=args.detect, heartbeat_timeout=args.heartbeat_timeout, **kwargs)
    co.start()
    print(f"ftc10d coordinator listening on {co.address} (detector {'on' if args.detect else 'off'}, "
          f"heartbeat timeout {args.heartbeat_timeout:g} s, records {'signed' if co.signer.signed else 'unsigned'})",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    last = None
    while not done.wait(0.2):
        cfg = co.latest
        if cfg is not None and cfg != last:
            print(f"epoch {cfg.epoch}: uuid {cfg.uuid}, {cfg.size} member(s) ({cfg.reason})", flush=True)
            last = cfg
    co.close()
    return 0


@subcommand(
    "launch",
    "run a training script on N workers; replace only a worker that dies, from warm spares",
    arg("--nproc-per-node", type=int, default=1, metavar="N", help="workers on this node (default: 1)"),
    arg("--spares", type=int, default=0, metavar="K",
        help="warm spares kept ready (torch and the script's imports done) to replace a dead worker (default: 0)"),
    arg("--max-restarts", type=int, default=3, metavar="R",
        help="respawns per slot before the slot is given up (default: 3)"),
    arg("--coordinator", default=None, metavar="HOST:PORT",
        help="use this membership coordinator (another node's launcher, or `ftc10d coordinator`) "
             "instead of hosting one here"),
    arg("--membership-endpoints", default=None, metavar="URL[,URL...]",
        help="keep the membership in this etcd cluster (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379,"
             "http://10.0.0.3:2379) instead of the coordinator store, which then only serves the process "
             "group's rendezvous; needs pip install 'ftc10d[etcd]'"),
    arg("--host", default="127.0.0.1", metavar="ADDR",
        help="bind address of the embedded coordinator (default: 127.0.0.1; 0.0.0.0 for multi-node)"),
    arg("--port", type=int, default=0, metavar="N", help="port of the embedded coordinator (default: 0, a free one)"),
    arg("--nnodes", type=int, default=1, metavar="N", help="nodes of the job, one launcher each (default: 1)"),
    arg("--node-rank", type=int, default=0, metavar="I", help="this node's index in [0, nnodes) (default: 0)"),
    arg("--heartbeat-timeout", type=float, default=1.0, metavar="SECONDS",
        help="a member whose heartbeat is silent this long is removed (default: 1)"),
    arg("--min-members", type=int, default=None, metavar="M",
        help="never form a configuration smaller than this, at most the job's world size (default: 1 on one "
             "node, a majority of nnodes x nproc-per-node on several)"),
    arg("--membership-unit", choices=("node", "rank"), default="node",
        help="node (default): this launcher is the node's member, its workers go through it, and the store serves "
             "one member per node; rank: every worker is a member of its own (store load grows with ranks)"),
    arg("--log-dir", default=None, metavar="DIR",
        help="write each worker's stdout/stderr to DIR/worker<slot>.<restart>.out|.err (default: inherit)"),
    arg("--gpus-per-node", type=int, default=None, metavar="G",
        help="GPUs this node's workers share (default: those visible); with more workers than GPUs each "
             "worker gets its own NCCL_HOSTID, so that NCCL ranks can share a GPU"),
    arg("--job-restarts", type=int, default=0, metavar="K",
        help="when the job stops itself (a worker exits 86: ftc10d.StateLostError or ReplicaDivergenceError), start "
             "every worker again, at most K times, as a new job: the script resumes from its last checkpoint "
             "(default: 0, the launcher exits 86)"),
    arg("script", help="the training script (a Python file); it calls ftc10d.train.init_from_env()"),
    arg("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script"),
)
def launch(args: argparse.Namespace) -> int:
    """Like torchrun, but a worker that dies is replaced alone: the launcher sees the
    exit within milliseconds (pidfd), reports it to the membership at once, and
    respawns that slot only (from a warm spare with --spares), while the survivors
    reconfigure in place and the replacement receives its state from a live peer.
    Hosts the membership coordinator unless --coordinator is given; with
    --membership-endpoints the membership lives in etcd instead. SIGINT/SIGTERM
    are forwarded to the workers (SIGKILL after a grace period). Exit code 0 when
    every worker exited 0."""
    from ftc10d.launch import LaunchConfig, run
    from ftc10d.types import InvalidOptionError

    config = LaunchConfig(
        script=args.script, script_args=list(args.script_args), nproc_per_node=args.nproc_per_node,
        spares=args.spares, max_restarts=args.max_restarts, coordinator=args.coordinator,
        membership_endpoints=None if args.membership_endpoints is None else args.membership_endpoints.split(","),
        host=args.host,
        port=args.port, nnodes=args.nnodes, node_rank=args.node_rank, heartbeat_timeout=args.heartbeat_timeout,
        min_members=args.min_members, log_dir=args.log_dir, gpus_per_node=args.gpus_per_node,
        membership_unit=args.membership_unit,
    )
    try:
        config.validate()
    except InvalidOptionError as exc:
        args.parser.error(str(exc))

    def show(event: Any) -> None:
        where = "" if event.slot is None else f" slot {event.slot}"
        pid = "" if event.pid is None else f" pid {event.pid}"
        detail = " ".join(f"{k}={v}" for k, v in event.detail.items())
        print(f"ftc10d launch: {event.kind}{where}{pid} {detail}".rstrip(), file=sys.stderr, flush=True)

    from ftc10d.types import EXIT_STOP_JOB

    code = run(config, on_event=show)
    for attempt in range(1, max(0, args.job_restarts) + 1):
        if code != EXIT_STOP_JOB:
            break
        # The job cannot go on from the live state (nobody holds its newest state, or the replicas
        # diverged): a new job -- new membership, fresh workers -- resumes from the checkpoint.
        print(f"ftc10d launch: the job stopped itself (exit {EXIT_STOP_JOB}); starting it again from its "
              f"checkpoint ({attempt} of {args.job_restarts})", file=sys.stderr, flush=True)
        code = run(config, on_event=show)
    if code == 0:
        print("ftc10d launch: every worker exited 0", file=sys.stderr, flush=True)
    else:
        print(f"ftc10d launch: the job failed (exit code {code}); see the log lines above", file=sys.stderr,
              flush=True)
    return code


@subcommand(
    "chaos",
    "randomized fault trials on a real DDP job (kill, freeze, slow, partition, ...) with the invariants checked",
    arg("--trials", type=int, default=5, metavar="N", help="number of trials (default: 5)"),
    arg("--seed", type=int, default=0, metavar="S",
        help="seed of the run; trial k's seed derives from it (default: 0)"),
    arg("--out", default="chaos-out", metavar="DIR",
        help="where summary.json and each trial's record go (default: chaos-out)"),
    arg("--replay", default=None, metavar="FILE",
        help="run the one trial recorded in FILE (DIR/trials/<k>-<seed>.json) again, same schedule"),
    arg("--hosts", type=int, default=1, metavar="H",
        help="spread the workers over H hosts (network namespaces; root only) and add partition faults (default: 1)"),
    arg("--world-size", type=int, default=None, metavar="N", help="workers per trial (default: 4, or R*S with --mesh)"),
    arg("--mesh", default=None, metavar="RxS",
        help="run the job as FT-HSDP: R replicas of S FSDP2 ranks (e.g. 2x2), invariant 1 checked per shard; "
             "adds the node fault (a whole replica SIGKILLed at once); one host"),
    arg("--steps", type=int, default=150, metavar="N",
        help="training steps per trial, ~0.06 s each (default: 150)"),
    arg("--heartbeat-timeout", type=float, default=0.75, metavar="SECONDS",
        help="membership heartbeat timeout of the job (default: 0.75)"),
    arg("--membership", choices=("tcp", "etcd"), default="tcp",
        help="where the job's membership lives: tcp, the coordinator TCPStore (default), or etcd, a 3-member "
             "cluster each trial starts on loopback (adds the etcd fault: one member SIGKILLed and restarted; "
             "needs the etcd binary and pip install 'ftc10d[etcd]'; --hosts 1 only)"),
    arg("--keep", action="store_true", help="keep the event files and logs of survived trials too"),
    arg("--weight", action="append", default=[], metavar="KIND=N",
        help="draw fault KIND N times as often as the others (repeatable; N=0: never), e.g. --weight die_vote=3"),
    arg("--backend", default=None, metavar="SPEC",
        help="the workers' group adapter (FTC10D_BACKEND), e.g. cpu:gloo,cuda:gloo-as-nccl: the two-channel group "
             "on CPU, its device channel Gloo with NCCL's semantics (default: as the workers pick, gloo here; "
             "give it again with --replay)"),
)
def chaos(args: argparse.Namespace) -> int:
    """Each trial launches the job through the launcher (warm spare included), injects a
    fault schedule drawn from the trial's seed, and checks: the final step was reached;
    invariant 1 (all fingerprints equal per committed step, no step lost or applied
    twice); invariant 3 (a fenced member id never commits or comes back); no process,
    /dev/shm entry or listening port left behind; the stall each fault caused. A failed
    trial prints its seed, schedule and the file to --replay. Exit code 0 iff every
    trial survived."""
    if args.trials < 1:
        args.parser.error("--trials must be at least 1")
    if args.mesh is not None:
        from ftc10d.demo.faults import parse_mesh

        try:
            args.mesh = parse_mesh(args.mesh)
        except argparse.ArgumentTypeError as exc:
            args.parser.error(str(exc))
        replicas, shard_size = args.mesh
        if args.world_size not in (None, replicas * shard_size):
            args.parser.error(f"--world-size {args.world_size} contradicts --mesh {replicas}x{shard_size} "
                              f"({replicas * shard_size} workers): give one of them")
        if replicas < 2:
            args.parser.error(f"--mesh {replicas}x{shard_size}: chaos needs at least 2 replicas (with one, a lost "
                              "rank loses its shard: StateLostError, by design)")
        if args.hosts != 1:
            args.parser.error("--mesh runs on one host: its node fault SIGKILLs a whole replica")
        args.world_size = replicas * shard_size
    elif args.world_size is None:
        args.world_size = 4
    if args.mesh is None and args.world_size < 3:
        args.parser.error("--world-size must be at least 3 (a removal must leave a majority)")
    if args.steps < 30:
        args.parser.error("--steps must be at least 30 (warm-up, faults, recovery)")
    if args.heartbeat_timeout <= 0:
        args.parser.error("--heartbeat-timeout must be positive")
    if not 1 <= args.hosts <= (args.world_size + 1) // 2:
        args.parser.error(f"--hosts must be in [1, {(args.world_size + 1) // 2}] with --world-size "
                          f"{args.world_size} (each extra host runs one worker, a minority)")
    if args.membership == "etcd" and args.replay is None:
        from ftc10d.chaos.etcd import ETCD, SKIP_REASON

        if args.hosts > 1:
            args.parser.error("--membership etcd runs its etcd cluster on loopback: use it with --hosts 1")
        if ETCD is None:
            args.parser.error(f"--membership etcd: {SKIP_REASON}")
    if args.backend is not None:
        from ftc10d.pg.backend import adapter
        from ftc10d.types import InvalidOptionError

        try:
            why = adapter(args.backend).unavailable()
        except InvalidOptionError as exc:
            why = str(exc)
        if why:
            args.parser.error(f"--backend {args.backend}: {why}")
        os.environ["FTC10D_BACKEND"] = args.backend  # the launcher's workers inherit it
    from ftc10d.chaos import runner
    from ftc10d.chaos.schedule import KINDS, ScheduleError

    weights: dict[str, int] = {}
    for item in args.weight:
        kind, _, n = item.partition("=")
        if kind not in KINDS or not n.isdigit():
            args.parser.error(f"--weight {item!r}: give KIND=N with KIND one of {', '.join(KINDS)} and N >= 0")
        weights[kind] = int(n)
    command = "ftc10d " + " ".join(sys.argv[1:])
    try:
        return runner.run(trials=args.trials, seed=args.seed, out=args.out, replay=args.replay, hosts=args.hosts,
                          world_size=args.world_size, steps=args.steps, heartbeat_timeout=args.heartbeat_timeout,
                          keep=args.keep, command=command, membership=args.membership, weights=weights,
                          mesh=list(args.mesh) if args.mesh is not None else None)
    except ScheduleError as exc:
        args.parser.error(str(exc))
        return 2
    except runner.RunInterrupted as exc:  # Ctrl-C or SIGTERM: the trial in progress was cleaned up
        print(f"ftc10d chaos: stopped by signal {exc.signum}; the finished trials are summarized in "
              f"{args.out}/summary.json", file=sys.stderr, flush=True)
        return 128 + exc.signum


@subcommand("version", "print the versions of ftc10d, torch and Python, and what this torch supports natively")
def version(args: argparse.Namespace) -> int:
    """Print versions; the native-contract line tells whether torch itself has
    the 2.14 reconfigure API (ftc10d provides it either way)."""
    import platform

    import torch

    import ftc10d
    from ftc10d import _compat

    native = "yes" if _compat.HAS_NATIVE_RECONFIGURE else "no (ftc10d provides it)"
    print(f"ftc10d {ftc10d.__version__}")
    print(f"torch {torch.__version__}")
    print(f"python {platform.python_version()}")
    print(f"torch has the reconfigure contract natively: {native}")
    return 0


# ===================================================================== entry


@subcommand(
    "trace",
    "analyse flight-recorder dumps (one per rank): who did not join which collective, per generation",
    arg("dir", help="folder with the dumps (ftc10d-fr-<rank>.json or torch-format <prefix><rank>)"),
    arg("--json", dest="as_json", action="store_true", help="machine-readable output"),
)
def trace(args: argparse.Namespace) -> int:
    from ftc10d.flight_recorder.analyze import main as analyze_main

    try:
        return analyze_main(args.dir, as_json=args.as_json)
    except FileNotFoundError as exc:
        print(f"ftc10d trace: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftc10d",
        description="ftc10d: PyTorch distributed training that survives the loss of a rank, in place.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the ftc10d library at INFO to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help, args, fn in _SUBCOMMANDS:
        p = sub.add_parser(name, help=help, description=fn.__doc__)
        for a in args:
            p.add_argument(*a.flags, **a.kwargs)
        p.set_defaults(handler=fn, parser=p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point (``ftc10d``, ``python -m ftc10d``); returns the exit code."""
    # Gloo's errors end in an emoji; never let a narrow stdout encoding turn a report into a crash.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())

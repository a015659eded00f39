"""How fast ``ftc10d launch`` replaces a killed worker, cold and from a warm spare.

A job of ``--nproc`` workers trains (``tests/train/scripts/train_job.py``, a small MLP
under DDP with the step-commit Manager) through a :class:`ftc10d.launch.Launcher`; once
every worker committed a few steps, one worker is SIGKILLed and the clock starts:

- **exit seen**: kill -> the launcher's ``exited`` event (pidfd readable, reaped);
- **reported**: kill -> ``reported`` (the confirmed removal agreed in the store);
- **admitted**: kill -> a configuration that includes the replacement's handle;
- **first step**: kill -> the replacement's first committed step (it received the state
  from a live peer, then trained one step with the others).

Each is measured ``--runs`` times with no spare (a cold ``python script.py``: interpreter,
torch, ftc10d, the script's imports) and with one warm spare (all that done ahead), and the
medians are printed with the warm/cold ratio. Run from the repository root::

    PYTHONPATH=src:. python benchmarks/launch_respawn.py [--runs 5] [--nproc 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from benchmarks._common import dump_json, machine, median, table
from ftc10d.launch import LaunchConfig, Launcher
from ftc10d.membership import Agreement, TCPMembershipStore
from ftc10d.membership.records import Signer
from ftc10d.train.bootstrap import handle_key

ROOT = Path(__file__).resolve().parents[1]
TRAIN_JOB = str(ROOT / "tests" / "train" / "scripts" / "train_job.py")
POLL_S = 0.002


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


def one_run(nproc: int, warm: bool, hb: float) -> dict[str, float]:
    """One kill and its replacement; seconds from the kill to each milestone."""
    opts = {"steps": 1_000_000, "interval": 0.01, "finishers": nproc}
    env = {"FTC10D_TEST_OPTS": json.dumps(opts),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    config = LaunchConfig(script=TRAIN_JOB, nproc_per_node=nproc, spares=1 if warm else 0, max_restarts=1,
                          heartbeat_timeout=hb, env=env)
    with Launcher(config) as launcher:
        host, _, port = launcher.coordinator_address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        agreement = Agreement(TCPMembershipStore(host, int(port)), Signer(config.effective_token))

        def step_of(pid: int) -> int:
            key = f"test/progress/{pid}"
            return int(store.get(key)) if store.check([key]) else 0

        pids = launcher.pids()
        _wait(lambda: all(step_of(p) >= 5 for p in pids.values()), 120, "every worker at step 5")
        if warm:
            _wait(lambda: any(e.kind == "spare_ready" for e in launcher.events), 120, "a ready spare")
        time.sleep(0.2)
        t_kill = time.time()
        victim = launcher.kill(nproc - 1, signal.SIGKILL)

        def event(kind: str) -> Optional[Any]:
            return next((e for e in launcher.events if e.kind == kind and e.time >= t_kill - 0.001), None)

        exited = _wait(lambda: event("exited"), 30, "the exit")
        reported = _wait(lambda: event("reported"), 30, "the report")
        respawned = _wait(lambda: event("respawned"), 30, "the respawn")
        new = respawned.pid
        assert respawned.detail["warm"] == warm, respawned
        key = handle_key(launcher.launch_id, new)
        handle = _wait(lambda: store.check([key]) and store.get(key).decode(), 120, "the replacement's handle")
        _wait(lambda: (cfg := agreement.latest()) is not None and handle in cfg.handles, 120, "the admission")
        t_admitted = time.time()
        _wait(lambda: step_of(new) > 0, 120, "the replacement's first step")
        t_step = time.time()
        assert victim not in launcher.pids().values()
    return {"exit_seen": exited.time - t_kill, "reported": reported.time - t_kill,
            "admitted": t_admitted - t_kill, "first_step": t_step - t_kill}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="kills per mode (default: 5)")
    parser.add_argument("--nproc", type=int, default=2, help="workers (default: 2)")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0, help="seconds (default: 1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for i in range(args.runs):
        for mode in ("cold", "warm"):  # interleaved: drift on the machine hits both alike
            r = one_run(args.nproc, mode == "warm", args.heartbeat_timeout)
            results[mode].append(r)
            print(f"run {i + 1} {mode}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r.items()),
                  file=sys.stderr, flush=True)
    keys = ["exit_seen", "reported", "admitted", "first_step"]
    med = {mode: {k: median([r[k] for r in rs]) for k in keys} for mode, rs in results.items()}
    rows = [[k.replace("_", " "), f"{med['cold'][k] * 1000:.1f}", f"{med['warm'][k] * 1000:.1f}",
             f"{med['warm'][k] / med['cold'][k]:.2f}"] for k in keys]
    print(f"launch_respawn: {args.nproc} workers, {args.runs} kills per mode, {machine()}")
    print("median ms from SIGKILL to:")
    print(table(["milestone", "cold", "warm spare", "warm/cold"], rows))
    dump_json(args.json, {"nproc": args.nproc, "runs": results, "median_s": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())

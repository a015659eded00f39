"""What recording the job's newest committed state costs (issue 24, invariant 8), against
plain torch DDP's step and against the Manager's commit without it.

The fix puts three things on a rank's path (``ftc10d.train.progress``):

- **per step**: ``Manager._commit`` compares this rank's recorded epoch with the
  configuration's (and, on the first rank, hands the identity to the reporter thread: an
  assignment). Measured directly: the same Manager object, ``_commit`` as shipped vs the
  commit without the record (``step += 1; commit_epoch = epoch``, what it was before),
  interleaved, 7 rounds of 100,000 calls each, median per call.
- **per configuration and rank**: one ``JobProgress.record`` (a read and, for the first
  writer, a compare-and-set on the coordinator's TCPStore) before the first commit there,
  and one ``JobProgress.read`` per recovery (the recovery read one fact before the fix too).
- **in the background**: the first rank's reporter merges once a second, off the step path.

The baseline step is plain torch DDP of the demo's model (0.46 M parameters, Adam, global
batch 128) over a plain Gloo group, 2 ranks, median of 300 steps after 30 of warm-up.
The cost per step is reported as ``(DDP step + added per step) / DDP step``; a configuration's
one-off record is reported beside a recovery's pause, which it lengthens.

    python benchmarks/job_progress.py [--json out.json]

Target (issue 24): inside 1.01x of plain DDP per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import dump_json, machine, run  # noqa: E402

ROUNDS, CALLS, STEPS, WARMUP = 7, 100_000, 300, 30


def ddp_step_times(rank: int, world: int, port: int) -> list[float]:
    """Plain torch DDP of the demo's model on a plain Gloo group: per-step seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks._common import client_store
    from ftc10d.demo.model import batch_for, loss_fn, make_student, make_teacher

    dist.init_process_group("gloo", store=dist.PrefixStore("ddp", client_store(port)), rank=rank, world_size=world)
    model = DistributedDataParallel(make_student(seed=0))
    teacher = make_teacher()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for step in range(STEPS + WARMUP):
        t0 = time.perf_counter()
        x, y = batch_for(teacher, step, rank, world)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times[WARMUP:]


def manager_costs() -> dict[str, Any]:
    """One rank under a real coordinator: the commit with and without the record, and the
    store operations of a configuration change."""
    from ftc10d.membership import Coordinator
    from ftc10d.train import Manager, init_from_env
    from ftc10d.train.progress import JobProgress

    co = Coordinator(detect=False).start()
    try:
        os.environ.update({"FTC10D_COORDINATOR": co.address, "RANK": "0", "WORLD_SIZE": "1"})
        pg, member = init_from_env()
        manager = Manager(pg, member)
        manager._cfg_epoch = member.current().epoch
        manager._commit()  # the configuration's first commit: recorded once (measured below)

        def without_record() -> bool:  # the commit as it was before the fix
            manager.step += 1
            manager.commit_epoch = manager._cfg_epoch
            return True

        def per_call(fn: Any) -> float:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            return (time.perf_counter() - t0) / CALLS

        shipped, before = [], []
        for _ in range(ROUNDS):  # interleaved: both see the same machine
            shipped.append(per_call(manager._commit))
            before.append(per_call(without_record))
        record, read = [], []
        for i in range(200):
            epoch = manager._cfg_epoch + 1 + i  # a new configuration's first commit each time: a real CAS
            t0 = time.perf_counter()
            JobProgress.record(member, (epoch, manager.step))
            record.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            JobProgress.read(member)
            read.append(time.perf_counter() - t0)
        manager.close()
        return {"commit_s": statistics.median(shipped), "commit_before_s": statistics.median(before),
                "record_s": statistics.median(record), "read_s": statistics.median(read)}
    finally:
        co.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    costs = manager_costs()
    steps = run(ddp_step_times, 2)
    step = statistics.median(statistics.median(v) for v in steps.values())
    added = costs["commit_s"] - costs["commit_before_s"]
    print(f"job progress record (issue 24): {machine()}")
    print("| what | baseline | with the record | added | ratio |")
    print("|---|---|---|---|---|")
    print(f"| Manager._commit, per call (median of {ROUNDS} x {CALLS:,}) | {costs['commit_before_s'] * 1e9:.0f} ns | "
          f"{costs['commit_s'] * 1e9:.0f} ns | {added * 1e9:+.0f} ns | "
          f"{costs['commit_s'] / costs['commit_before_s']:.2f}x |")
    ratio = (step + max(added, 0.0)) / step
    verdict = "met" if ratio <= 1.01 else "MISSED"
    print(f"| plain DDP step, 2 ranks (median of {STEPS}) | {step * 1e3:.2f} ms | {(step + added) * 1e3:.4f} ms | "
          f"{added * 1e9:+.0f} ns | {ratio:.5f}x (target <= 1.01x: {verdict}) |")
    print(f"| per configuration and rank: JobProgress.record (TCPStore read + CAS) | - | "
          f"{costs['record_s'] * 1e6:.0f} us | once, before the first commit | - |")
    print(f"| per recovery and rank: JobProgress.read (also read before the fix) | {costs['read_s'] * 1e6:.0f} us | "
          f"{costs['read_s'] * 1e6:.0f} us | 0 | 1.00x |")
    print(f"| first rank's reporter thread: one merge a second | - | {costs['record_s'] * 1e6:.0f} us/s | "
          f"{costs['record_s'] * 100:.3f}% of a core | - |")
    dump_json(args.json, {**costs, "ddp_step_s": step, "ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())

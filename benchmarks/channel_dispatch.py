"""The two-channel group's dispatch on the issue path (issue 27): what ``Communicator.channel_for``
adds per op, for a one-adapter group (it returns itself) and for ``cpu:gloo,cuda:...`` (the
tensors' device, the control scope, the per-channel counter), each beside the same call's
baseline in one run (timeit, medians of 5 repeats). No process group is connected: this is the
Python cost of the choice, not of an op.

    .venv/bin/python benchmarks/channel_dispatch.py
"""

from __future__ import annotations

import statistics
import timeit

import torch

from ftc10d.pg.channels import channels_adapter, parse
from ftc10d.pg.gloo import GlooCommunicator

SPEC = "cpu:gloo,cuda:gloo-as-nccl"
N = 200_000


def per_op(fn) -> float:
    return statistics.median(timeit.repeat(fn, number=N, repeat=5)) / N


def main() -> None:
    tensors = [torch.ones(4)]
    one = GlooCommunicator.__new__(GlooCommunicator)  # channel_for reads no state
    cls = channels_adapter(SPEC, parse(SPEC))
    cpu, dev = (sub.__new__(sub) for _, sub in cls.specs)
    cpu.backend = dev.backend = None
    two = cls({"cpu": cpu, "cuda": dev}, 0, 2)
    base = per_op(lambda: tensors or [])
    a = per_op(lambda: one.channel_for(tensors or []))
    b = per_op(lambda: two.channel_for(tensors or []))
    print(f"channel_for per op: one adapter {(a - base) * 1e9:.0f} ns | two channels ({SPEC}) "
          f"{(b - base) * 1e9:.0f} ns | ratio {(b - base) / max(a - base, 1e-12):.1f}x")


if __name__ == "__main__":
    main()

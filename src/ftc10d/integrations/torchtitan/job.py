"""Drive a torchtitan job on ftc10d under a real ``ftc10d launch``, SIGKILL its workers,
read back every rank's events (``--ftc10d.events``). Used by ``make demo-titan``
(:mod:`.demo`), the tests (``tests/integrations/``) and ``benchmarks/titan_recovery.py``."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

#: torchtitan's llama3 debug model, small and fast on CPU (as in the README's CPU command).
MODEL_FLAGS = ["--module", "ftc10d.integrations.torchtitan", "--config", "llama3_debugmodel",
               "--training.seq-len", "256", "--training.local-batch-size", "2",
               "--training.mixed-precision-param", "float32", "--debug.seed", "0",
               "--parallelism.spmd-backend", "partial_dtensor", "--metrics.disable-color-printing",
               "--dataloader.dataset", "c4_test"]


def script() -> str:
    from ftc10d.integrations.torchtitan import train

    return train.__file__


@dataclass
class TitanJob:
    """One ``ftc10d launch`` of the torchtitan trainer on ``replicas x shard`` workers."""

    out: str
    steps: int
    replicas: int = 2
    shard: int = 2
    extra: list[str] = field(default_factory=list)
    launch_args: list[str] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None

    def start(self, assets: tuple[str, str]) -> "TitanJob":
        os.makedirs(self.out, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   HF_DATASETS_CACHE=os.path.join(self.out, "hf"), OMP_NUM_THREADS="1", FTC10D_TITAN_DEVICE="cpu")
        cmd = [sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", str(self.replicas * self.shard),
               "--log-dir", os.path.join(self.out, "logs"), *self.launch_args, script(), *MODEL_FLAGS,
               "--ftc10d.replicas", str(self.replicas), "--ftc10d.events", self.events_dir,
               "--ftc10d.fingerprint-every", "1", "--hf-assets-path", assets[0],
               "--dataloader.dataset-path", assets[1], "--dump-folder", os.path.join(self.out, "dump"),
               "--training.steps", str(self.steps), *self.extra]
        self.log = open(os.path.join(self.out, "launch.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    @property
    def events_dir(self) -> str:
        return os.path.join(self.out, "events")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(glob.glob(os.path.join(self.events_dir, "*.jsonl"))):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        out.append(json.loads(line))
        return out

    def committed(self, slot: Optional[int] = None, restart: Optional[int] = None) -> int:
        """The newest step committed (by ``slot``'s ``restart``-th process, if given)."""
        steps = [e["step"] for e in self.events() if e["kind"] == "step" and e["ok"]
                 and (slot is None or e["slot"] == slot) and (restart is None or e["restart"] == restart)]
        return max(steps, default=0)

    def wait(self, what: str, cond: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the job ended (exit {self.proc.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    def pid(self, slot: int) -> int:
        """The pid of ``slot``'s newest process."""
        admitted = [e for e in self.events() if e["kind"] == "admitted" and e["slot"] == slot]
        return max(admitted, key=lambda e: e["restart"])["pid"]

    def kill(self, *slots: int) -> float:
        """SIGKILL the slots' current processes at once; returns the time of the kill."""
        pids = [self.pid(s) for s in slots]
        t = time.time()
        for p in pids:
            os.kill(p, signal.SIGKILL)
        return t

    def finish(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
            raise AssertionError(f"the job did not finish within {timeout:.0f} s; see {self.out}") from None
        finally:
            self.log.close()

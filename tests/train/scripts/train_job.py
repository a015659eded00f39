"""The training job that ``ftc10d launch`` runs in the end-to-end tests.

Options come as JSON in ``$FTC10D_TEST_OPTS``; fingerprints, progress and the
result go to the coordinator store under ``test/`` (the launcher's store is the
only thing every worker and the test share).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.train.job

import torch.distributed as dist  # noqa: E402

from ftc10d.train import init_from_env  # noqa: E402
from tests.train.job import train_loop  # noqa: E402


def main() -> int:
    opts = json.loads(os.environ["FTC10D_TEST_OPTS"])
    host, _, port = os.environ["FTC10D_COORDINATOR"].rpartition(":")
    control = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    pg, member = init_from_env()
    out = train_loop(pg, member, opts, lambda k, v: control.set(f"test/{k}", v), int(os.environ["RANK"]),
                     lambda key: control.add(f"test/{key}", 1) == 1)
    manager = out.pop("manager")
    control.set(f"test/result/{os.getpid()}", json.dumps(out))
    control.add("test/finished", 1)
    deadline = time.monotonic() + 30
    while int(control.add("test/finished", 0)) < opts["finishers"] and time.monotonic() < deadline:
        time.sleep(0.02)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tests/train/scripts/train_job.py with the ftc10d library logging at INFO to stderr
(the launcher's log_dir keeps it per worker: what a failed end-to-end test prints)."""

import logging
import runpy
import sys
from pathlib import Path

import tests.train.job  # noqa: F401  (imported ahead by a warm spare, like train_job.py's own imports)
from ftc10d.train import init_from_env  # noqa: F401

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(threadName)s %(message)s")
    script = str(Path(__file__).resolve().parents[2] / "train" / "scripts" / "train_job.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")

"""A worker that stops the job (exit 86, EXIT_STOP_JOB) until the job has been started N times:
``stop_job_until.py DIR N``. Each worker records its launch id in DIR."""

import os
import sys
from pathlib import Path

out, launches = Path(sys.argv[1]), int(sys.argv[2])
launch_id = os.environ["FTC10D_LAUNCH_ID"]
# Written whole (a temporary file renamed): the launcher stops this worker as soon as the other
# one exits 86, and a kill between the file's creation and its write left it empty (a test flake).
name = f"{launch_id}.{os.environ['RANK']}"
(out / f".{name}.tmp").write_text(os.environ.get("FTC10D_RESTART_COUNT", ""))
os.replace(out / f".{name}.tmp", out / name)
seen = {p.name.split(".")[0] for p in out.iterdir() if not p.name.startswith(".")}
sys.exit(0 if len(seen) >= launches else 86)

"""Helpers of the launcher tests: bounded waits on real processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

SCRIPTS = Path(__file__).parent / "scripts"


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def records(folder: Path) -> dict[int, dict[str, Any]]:
    """pid -> what scripts/record_env.py recorded."""
    out = {}
    for p in folder.glob("*.json"):
        out[int(p.stem)] = json.loads(p.read_text())
    return out


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The test process's environment with the worktree importable (for ``python -m ftc10d``)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env

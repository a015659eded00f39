"""A warm spare: a process that has paid for its imports before it is needed.

A replacement worker started cold spends seconds importing torch, ftc10d and
the script's own dependencies before it can even join the membership; while it
does, the survivors train one replica short. A spare does that work ahead of
time, then blocks on a pipe. Promoted, it receives its slot's environment and
argv through the pipe and runs the script with ``runpy.run_path(script,
run_name="__main__")``, exactly as ``python script.py`` would, minus the imports
already done.

Rules the launcher relies on:

- the script is never executed early: only its top-level ``import`` /
  ``from ... import`` statements are found (with :mod:`ast`) and those modules
  imported; one that fails to import is skipped (the script will meet the same
  error itself, at its own time);
- a spare does not join the membership (nothing of ``ftc10d`` is *called*, only
  imported), so it never counts as a member before it is promoted;
- EOF on the control pipe without a message means "not needed": exit 0.

Run as ``python -m ftc10d.launch.spare --control-fd N --ready-fd M script.py``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import os
import runpy
import sys
import time
from typing import Any, Optional

logger = logging.getLogger("ftc10d")

#: What every worker imports, whatever its script says (the ftc10d layers a worker uses).
BASE_MODULES = ("torch", "torch.distributed", "ftc10d", "ftc10d.pg", "ftc10d.membership", "ftc10d.train")


def _imports_of(stmts: list[ast.stmt]) -> list[str]:
    out: list[str] = []
    for node in stmts:
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                out.append(node.module)
        elif isinstance(node, ast.If):
            # `if TYPE_CHECKING:` / version switches: both branches are top level
            out += _imports_of(node.body) + _imports_of(node.orelse)
        elif isinstance(node, ast.Try):
            out += _imports_of(node.body) + _imports_of(node.orelse) + _imports_of(node.finalbody)
            for handler in node.handlers:
                out += _imports_of(handler.body)
    return out


def scan_imports(script: str) -> list[str]:
    """The modules ``script`` imports at top level (module body, and the bodies of
    top-level ``if``/``try``), in order, without duplicates; never runs the script.
    Relative imports are skipped (a script has no package). A script that does not
    parse yields ``[]``: its own run will report the syntax error."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    seen: dict[str, None] = {}
    for name in _imports_of(tree.body):
        seen.setdefault(name, None)
    return list(seen)


def warm_up(script: str) -> tuple[list[str], list[str]]:
    """Import the base modules and the script's top-level imports, as ``python
    script.py`` would find them (``sys.path[0]`` = the script's folder).
    Returns ``(imported, skipped)``."""
    sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]
    imported, skipped = [], []
    for name in list(BASE_MODULES) + scan_imports(script):
        try:
            importlib.import_module(name)
            imported.append(name)
        except BaseException as exc:  # noqa: BLE001 - a module's import may even sys.exit
            logger.debug("spare: skipped import of %s: %s", name, exc)
            skipped.append(name)
    return imported, skipped


def read_message(fd: int) -> Optional[dict[str, Any]]:
    """Block until the launcher writes the promotion (one JSON object) and closes
    the pipe; None on EOF without one (the launcher retired us, or is gone)."""
    chunks = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    raw = b"".join(chunks).strip()
    return json.loads(raw) if raw else None


def _redirect(path: Optional[str], target: int) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)


def promote(script: str, message: dict[str, Any]) -> None:
    """Become the worker: environment, argv, output files, then run the script as ``__main__``."""
    os.environ.clear()
    os.environ.update(message["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(message.get("stdout"), 1)
    _redirect(message.get("stderr"), 2)
    sys.argv = [script] + list(message.get("argv", []))
    runpy.run_path(script, run_name="__main__")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftc10d.launch.spare", description=__doc__)
    parser.add_argument("--control-fd", type=int, required=True, help="pipe the promotion message arrives on")
    parser.add_argument("--ready-fd", type=int, required=True, help="pipe to announce readiness on")
    parser.add_argument("script")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    imported, skipped = warm_up(args.script)
    with os.fdopen(args.ready_fd, "wb", buffering=0) as ready:
        ready.write(json.dumps({"ready_s": time.monotonic() - t0, "imported": len(imported),
                                "skipped": skipped}).encode() + b"\n")
    message = read_message(args.control_fd)
    if message is None:
        return 0
    promote(args.script, message)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Run as ``python -m ftc10d.launch.spare --control-fd N --ready-fd M script.py``. A cold
worker runs this file by its path with ``--run script.py args...`` (by path, so that
nothing is imported before the script: ``python -m`` would import ``ftc10d``, hence
torch), so that warm and cold workers run and exit the same way (:func:`exit_now`).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import json
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import Any, NoReturn, Optional

logger = logging.getLogger("ftc10d")

#: What every worker imports, whatever its script says: the ftc10d layers a worker uses, and
#: what torch imports lazily on the first optimizer a script builds (``torch._dynamo``, about
#: 1.5 s): a replacement builds its optimizer right after it was admitted, while the
#: survivors wait for it at the next step.
BASE_MODULES = ("torch", "torch.distributed", "ftc10d", "ftc10d.pg", "ftc10d.membership", "ftc10d.train",
                "torch.optim", "torch._dynamo", "torch.nn.parallel")


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
    # The etcd client (etcd3gw, requests) when the job's membership is there: the launcher sets
    # the variable for spares too (it does not depend on the slot). The name is
    # ftc10d.train.bootstrap.MEMBERSHIP_ENDPOINTS_ENV, spelled out: importing it imports torch.
    etcd = ["ftc10d.membership.etcd", "etcd3gw"] if os.environ.get("FTC10D_MEMBERSHIP_ENDPOINTS") else []
    for name in list(BASE_MODULES) + etcd + scan_imports(script):
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


def promote(script: str, message: dict[str, Any]) -> int:
    """Become the worker: environment, output files, then run the script; returns its exit status."""
    os.environ.clear()
    os.environ.update(message["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(message.get("stdout"), 1)
    _redirect(message.get("stderr"), 2)
    return run_script(script, list(message.get("argv", [])))


def run_script(script: str, args: list[str]) -> int:
    """Run ``script`` as ``__main__`` like ``python script args`` would; returns the exit
    status that python would have exited with (an uncaught exception prints its traceback: 1)."""
    sys.argv = [script, *args]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:
        # What the interpreter does with an uncaught exception: sys.excepthook prints it (a hook
        # the script installed may do more: init_from_env's exits EXIT_STOP_JOB on a state loss).
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit like the interpreter would (non-daemon threads joined, ``atexit`` handlers run,
    stdio flushed), but without tearing the interpreter down.

    Why: on Python < 3.14 a daemon thread blocked in a torch C++ call that releases the
    GIL (the membership watcher's server-side TCPStore wait, Gloo's threads) and returning
    *during* finalization is killed by ``pthread_exit``, whose forced unwind through a
    ``noexcept`` frame calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT. Workers finish together and each one's leave wakes the others'
    waits, so without this a worker that finished training would often be seen dying
    by SIGABRT, and be respawned. (The test harness exits its workers the same way.)"""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftc10d.launch.spare", description=__doc__)
    parser.add_argument("--control-fd", type=int, help="spare: pipe the promotion message arrives on")
    parser.add_argument("--ready-fd", type=int, help="spare: pipe to announce readiness on")
    parser.add_argument("--run", action="store_true",
                        help="no spare: run the script now (a cold start, with the same exit path as a warm one)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.run:
        exit_now(run_script(args.script, args.script_args))
    if args.control_fd is None or args.ready_fd is None:
        parser.error("a spare needs --control-fd and --ready-fd (or --run to run the script now)")
    t0 = time.monotonic()
    imported, skipped = warm_up(args.script)
    try:
        os.write(args.ready_fd, json.dumps({"ready_s": time.monotonic() - t0, "imported": len(imported),
                                            "skipped": skipped}).encode() + b"\n")
    except BrokenPipeError:
        pass  # promoted before it was ready: the launcher no longer listens
    os.close(args.ready_fd)
    message = read_message(args.control_fd)
    if message is None:
        return 0
    exit_now(promote(args.script, message))


if __name__ == "__main__":
    sys.exit(main())

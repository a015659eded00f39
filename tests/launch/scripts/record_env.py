"""A launcher test worker that needs no torch: records what it was given, then exits or sleeps.

``record_env.py DIR [--exit N] [--exit-rank R] [--sleep] [--sleep-s S]``: writes ``DIR/<pid>.json`` (its environment,
argv, and whether torch was already imported when the script began, i.e. a warm spare ran it).
"""

import sys

PRELOADED = "torch" in sys.modules  # first thing: a cold `python script.py` has not imported torch

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402


def main() -> int:
    out = sys.argv[1]
    info = {"pid": os.getpid(), "argv": sys.argv[1:], "env": dict(os.environ), "preloaded": PRELOADED}
    tmp = os.path.join(out, f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.rename(tmp, os.path.join(out, f"{os.getpid()}.json"))
    if "--exit-rank" in sys.argv and os.environ.get("RANK") == sys.argv[sys.argv.index("--exit-rank") + 1]:
        return int(sys.argv[sys.argv.index("--exit") + 1])  # only that rank exits, with --exit's code
    if "--sleep-s" in sys.argv:
        time.sleep(float(sys.argv[sys.argv.index("--sleep-s") + 1]))
    if "--sleep" in sys.argv:
        while True:
            time.sleep(1)
    if "--exit" in sys.argv:
        return int(sys.argv[sys.argv.index("--exit") + 1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

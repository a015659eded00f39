"""Run torch's distributed suite on Gloo and on ftc10d, the same selection, and fail on any
test that passes on Gloo and not on ftc10d (issue 25, invariant 7).

    python -m tests.torch_suite.compare [--world-sizes 2,3] [-k EXPR] [--out DIR]

For each world size, :mod:`tests.torch_suite.suite_cases` runs under pytest once with
``FTC10D_SUITE_BACKEND=gloo`` and once with ``ftc10d`` (both held to Gloo's expectations);
the JUnit reports are compared test by test. A test excluded on purpose is listed in
:data:`EXCLUDED` with its reason (the README's "torch's own test suite" lists them too).
Prints a table and exits 0 only if nothing that passes on Gloo fails on ftc10d.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("suite_cases.py")

#: test name -> why it is not compared (kept in step with the README).
EXCLUDED: dict[str, str] = {
    "test_get_backend": "asserts dist.get_backend() == $BACKEND, which is 'gloo' here (so that the rest of the suite "
                        "holds ftc10d to Gloo's expectations); an ftc10d group's backend is 'ftc10d', and so are its "
                        "sub-groups' (tests/pg/test_subgroups.py)",
}


def run_backend(backend: str, world_size: int, expr: str, out: Path) -> dict[str, str]:
    """Test name -> passed / failed / skipped, for one backend and world size."""
    report = out / f"{backend}-ws{world_size}.xml"
    env = dict(os.environ, FTC10D_SUITE_BACKEND=backend, WORLD_SIZE=str(world_size),
               TEMP_DIR=tempfile.mkdtemp(prefix=f"torch-suite-{backend}-"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES), f"--junitxml={report}"]
    if expr:
        cmd += ["-k", expr]
    t0 = time.monotonic()
    with open(out / f"{backend}-ws{world_size}.log", "w") as log:  # pytest's own output, kept for a failure
        subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    print(f"  {backend}, world size {world_size}: {time.monotonic() - t0:.0f} s", flush=True)
    outcome: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome[case.get("name", "?")] = ("failed" if tags & {"failure", "error"} else
                                          "skipped" if "skipped" in tags else "passed")
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("-k", dest="expr", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ftc10d-torch-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    regressions: list[str] = []
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        gloo = run_backend("gloo", ws, args.expr, out)
        ours = run_backend("ftc10d", ws, args.expr, out)
        counts = {b: {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "skipped")}
                  for b, res in (("gloo", gloo), ("ftc10d", ours))}
        print(f"world size {ws}: gloo {counts['gloo']}, ftc10d {counts['ftc10d']}")
        for name, result in sorted(gloo.items()):
            if result == "passed" and ours.get(name) != "passed":
                if name in EXCLUDED:
                    print(f"  excluded: {name} ({ours.get(name, 'missing')} on ftc10d): {EXCLUDED[name]}")
                else:
                    got = ours.get(name, "missing")
                    regressions.append(f"world size {ws}: {name}: passes on gloo, {got} on ftc10d")
    for line in regressions:
        print("REGRESSION " + line)
    print(f"reports in {out}; {len(regressions)} test(s) pass on gloo and not on ftc10d")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())

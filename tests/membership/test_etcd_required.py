"""CI must run the etcd tests, not skip them: with ``FTC10D_REQUIRE_ETCD=1`` (``.ci/run`` sets it)
a missing etcd fails them (``tests/conftest.py``). Real pytest runs in a subprocess, with etcd
hidden from its PATH, over both kinds of etcd skip: a ``skipif`` mark and a fixture's ``pytest.skip``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftc10d.chaos.etcd import SKIP_REASON
from tests.conftest import REQUIRE_ETCD_ENV

ROOT = Path(__file__).resolve().parents[2]
#: A skipif-marked test, and the etcd case of a fixture that skips.
ETCD_TESTS = ["tests/membership/test_stores.py::test_etcd_one_of_three_killed_has_no_effect",
              "tests/membership/test_failures.py::test_kill_one_of_four[etcd]"]


def _pytest_without_etcd(require: bool) -> subprocess.CompletedProcess[str]:
    path = [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
            if d and not os.access(os.path.join(d, "etcd"), os.X_OK)]
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ETCD_ENV}
    env.update(PATH=os.pathsep.join(path), **({REQUIRE_ETCD_ENV: "1"} if require else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ETCD_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("require", [False, True], ids=["plain", "required"])
def test_a_missing_etcd_skips_the_etcd_tests_unless_they_are_required(require: bool) -> None:
    run = _pytest_without_etcd(require)
    out = run.stdout + run.stderr
    summary = out.strip().splitlines()[-1]
    assert SKIP_REASON in out, out
    if require:
        assert run.returncode == 1 and "2 error" in summary and "skipped" not in summary, out
        assert f"{REQUIRE_ETCD_ENV}=1" in out, out
    else:
        assert run.returncode == 0 and "2 skipped" in summary, out

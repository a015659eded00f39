"""Test-wide settings and fixtures: flight-recorder dumps go to a temporary folder, never
to ~/.cache; ``coordinator`` is a real membership coordinator (TCPStore) in the test process;
with ``FTC10D_REQUIRE_ETCD=1`` (CI) a test that would skip for want of etcd fails instead."""

import os
import tempfile
from typing import Any, Iterator

import pytest

from ftc10d.chaos.etcd import SKIP_REASON as ETCD_SKIP_REASON
from ftc10d.membership import Coordinator

os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.mkdtemp(prefix="ftc10d-fr-"), "rank_"))

#: Set (to 1) where the etcd tests must run: ``.ci/run``, after ``make test`` installed etcd.
REQUIRE_ETCD_ENV = "FTC10D_REQUIRE_ETCD"
#: Set (to 1) where the torchtitan tests must run: ``.ci/run``'s ``make test-titan``. Their skip
#: reasons name that target.
REQUIRE_TITAN_ENV = "FTC10D_REQUIRE_TITAN"
TITAN_SKIP_MARK = "make test-titan"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Every etcd test skips with the same reason (a ``skipif`` mark, or ``pytest.skip`` in a
    fixture): under ``FTC10D_REQUIRE_ETCD=1`` that skip is reported as a failure."""
    report = yield
    if report.skipped and os.environ.get(REQUIRE_ETCD_ENV) == "1" and ETCD_SKIP_REASON in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"{ETCD_SKIP_REASON}; {REQUIRE_ETCD_ENV}=1 (as in CI) requires the etcd tests to run"
    if report.skipped and os.environ.get(REQUIRE_TITAN_ENV) == "1" and TITAN_SKIP_MARK in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"{report.longrepr}; {REQUIRE_TITAN_ENV}=1 (as in CI) requires the torchtitan tests to run"
    return report


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    """A coordinator in the test process; members watch each other (its detector is off)."""
    co = Coordinator(detect=False).start()
    try:
        yield co
    finally:
        co.close()

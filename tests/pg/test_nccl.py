"""The contract on NCCL (issue 17): several ranks on one GPU (each its own ``NCCL_HOSTID``),
CUDA tensors, real signals. Skipped without CUDA and NCCL (CPU CI): the adapter's
bookkeeping is covered there by ``tests/pg/test_backend.py``.

- an all-reduce is correct, and the group reconfigures in place to the survivors of a kill;
- a frozen peer (SIGSTOP): ``abort()`` releases the pending wait with ``ProcessGroupAborted``
  (never a normal return), and the op's output (a guard buffer) never changes after
  ``abort()`` returned;
- a killed peer (SIGKILL): the pending op fails with a typed ``CollectiveError`` and the
  survivors live on (torch's watchdog does not tear them down).
"""

from __future__ import annotations

import pytest

from ftc10d.pg.nccl import unavailable_reason
from tests.pg import nccl_scenarios as sc

pytestmark = pytest.mark.skipif(bool(unavailable_reason()), reason=f"NCCL: {unavailable_reason()}")


def test_allreduce_kill_and_reconfigure_on_nccl() -> None:
    res = sc.run_kill()
    assert not sc.check_kill(res), (sc.check_kill(res), res)


def test_a_frozen_peer_is_released_by_abort_and_nothing_writes_after_it() -> None:
    res = sc.run_frozen()
    assert not sc.check_frozen(res), (sc.check_frozen(res), res)

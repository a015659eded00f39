"""A group mid-recovery is aborted by any newer configuration (``Member.recovering``).

Chaos finding 35 (docs/reliability.md): after both ranks of a replica were killed, a
survivor entered its recovery's first collective in the configuration that dropped them,
while its peer adopted the next one (a replacement's join) before it finished connecting
that one, and went straight on: the survivor waited 15 s for it, until fenced, because a
configuration that only adds members did not abort the running group. Real processes,
real Gloo sockets, a real TCPStore; the peer that skips is modelled by a rank that does
not issue the op (what the skipping peer does), the join is a real join.
"""

from __future__ import annotations

import time
from typing import Any

from tests import harness
from tests.membership.conftest import tcp_spec, wait_states
from tests.membership.workers import recovering_worker

PG_TIMEOUT = 30.0


def test_a_join_aborts_a_recovery_a_peer_skipped_but_not_a_running_step(coordinator: Any) -> None:
    opts = {"expected": 2, "pg_timeout": PG_TIMEOUT, "rendezvous_timeout": 60.0}
    job = harness.start(recovering_worker, 4, tcp_spec(coordinator), opts)
    try:
        wait_states(job.store, [0], lambda s: s[0].get("phase") == "A", 60, "rank 0 in its recovery's all-reduce")
        time.sleep(0.3)  # rank 0 is waiting in the op
        job.store.set("test/join2", "1")
        wait_states(job.store, [1], lambda s: s[1].get("phase") == "B", 60, "rank 1 on the 3-member configuration")
        time.sleep(0.3)  # ranks 0 and 2 are waiting in the op rank 1 has not issued yet
        job.store.set("test/join3", "1")
        wait_states(job.store, [0, 1, 2, 3], lambda s: all(v.get("done") for v in s.values()), 90,
                    "every rank on the 4-member configuration")
        job.store.set("test/stop", "1")
        res = job.collect(timeout=60)
    finally:
        job.close()
    a = res[0]
    print(f"recovery all-reduce ended {a['A']} {a['A_seconds']:.3f} s after it was issued (the join was "
          "requested 0.3 s after it)")
    # A: aborted by the join (ProcessGroupAborted), well before the op's own timeout (30 s:
    # CollectiveTimeoutError, what it was before the fix)
    assert a["A"] == "ProcessGroupAborted", a
    assert a["A_seconds"] < PG_TIMEOUT / 3, a
    assert res[1]["entry_aborted"] is True, res[1]
    # B: the join of rank 3 was adopted by rank 1 before it issued the op, and the op
    # completed on the 3-member configuration (not aborted)
    assert res[1]["B_epoch"] > res[0]["A_epoch"] > 0
    for r in (0, 1, 2):
        assert res[r]["B"] == [3.0] * 4 and res[r]["B_uuid_kept"], res[r]
    assert {tuple(res[r]["final"])[1] for r in res} == {4}

"""Store connects do not wait for a nameserver (``store_connect.py``, finding 37).

torch's TCPStore makes a reverse DNS lookup at each connect and accept; a nameserver
that drops the query makes the connect wait out the resolver's timeout. The test runs a
store and a client in a private network and mount namespace whose ``resolv.conf`` names
a nameserver that never answers (a real UDP socket on 127.0.0.1:53 that reads queries
and drops them), with a 2-s resolver timeout. With torch's lookups kept
(``FTC10D_REVERSE_DNS=1``) the first connect waits the 2 s (which shows the test reaches
the lookup at all); with ftc10d's default it connects in milliseconds, and so does the
server's side (a second client's ``set`` through the same server).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare and iproute2 to give a process its own network and resolv.conf",
)

CHILD = textwrap.dedent("""
    import json, socket, sys, threading, time
    from datetime import timedelta

    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.1", 53))
    queries = []

    def swallow():
        while True:
            data, _ = dns.recvfrom(4096)
            queries.append(len(data))

    threading.Thread(target=swallow, daemon=True).start()

    import torch.distributed as dist
    from ftc10d.store_connect import connect_client, skip_reverse_dns

    state = skip_reverse_dns()
    t0 = time.monotonic()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t1 = time.monotonic()
    client = connect_client("127.0.0.1", server.port, timedelta(seconds=30))
    t2 = time.monotonic()
    client.set("k", "v")
    other = connect_client("127.0.0.1", server.port, timedelta(seconds=30))
    value = other.get("k").decode()
    t3 = time.monotonic()
    print(json.dumps({"state": state, "server_s": t1 - t0, "connect_s": t2 - t1, "second_s": t3 - t2,
                      "value": value, "queries": len(queries)}))
""")


def _run(tmp_path: Path, keep: bool) -> dict:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:2 attempts:1\n")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env.pop("RES_OPTIONS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if keep:
        env["FTC10D_REVERSE_DNS"] = "1"
    else:
        env.pop("FTC10D_REVERSE_DNS", None)
    inner = f"ip link set lo up && mount --bind {resolv} /etc/resolv.conf && exec {sys.executable} {script}"
    out = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", inner], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchs_reverse_lookup_waits_for_a_silent_nameserver(tmp_path: Path) -> None:
    """The control: torch's own behaviour, kept, waits out the resolver's timeout."""
    r = _run(tmp_path, keep=True)
    assert r["state"] == "kept"
    assert r["queries"] >= 1, r
    assert r["server_s"] + r["connect_s"] >= 1.5, r  # the 2-s resolver timeout, at least once
    assert r["value"] == "v"


def test_a_store_connect_does_not_wait_for_a_silent_nameserver(tmp_path: Path) -> None:
    r = _run(tmp_path, keep=False)
    assert r["state"] == "off", r
    assert r["server_s"] < 1.0 and r["connect_s"] < 1.0 and r["second_s"] < 1.0, r
    assert r["queries"] == 0, r  # not one query reached the nameserver
    assert r["value"] == "v"

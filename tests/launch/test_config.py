"""Unit tests of the launcher's pure parts: option validation, worker environment, import scanning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ftc10d import InvalidOptionError
from ftc10d.launch import LaunchConfig
from ftc10d.launch.env import base_env, visible_gpus, worker_env
from ftc10d.launch.spare import scan_imports
from ftc10d.train.bootstrap import WorkerEnv

SCRIPT = str(Path(__file__).parent / "scripts" / "record_env.py")


@pytest.mark.parametrize("changes, words", [
    ({"script": "/nonexistent/train.py"}, "does not exist"),
    ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1"),
    ({"spares": -1}, "--spares must be 0 or more"),
    ({"max_restarts": -2}, "--max-restarts must be 0 or more"),
    ({"nnodes": 2, "node_rank": 2}, "--node-rank must be in [0, 2)"),
    ({"nnodes": 2, "node_rank": 1}, "give --coordinator HOST:PORT"),
    ({"nnodes": 2}, "give --host 0.0.0.0"),
    ({"coordinator": "nohost"}, "is not HOST:PORT"),
    ({"coordinator": "h:99999"}, "is not HOST:PORT"),
    ({"coordinator": "h:29400", "port": 5}, "--port only applies to the embedded coordinator"),
    ({"port": 70000}, "--port must be in [0, 65535]"),
    ({"heartbeat_timeout": 0.0}, "--heartbeat-timeout must be positive"),
    ({"min_members": 0}, "--min-members must be at least 1"),
    ({"token": ""}, "token is empty"),
    ({"env": {"A=B": "x"}}, "is not NAME=string"),
    ({"membership_endpoints": []}, "--membership-endpoints is empty"),
    ({"gpus_per_node": -1}, "--gpus-per-node must be 0 or more"),
    ({"membership_endpoints": ["127.0.0.1:2379"]}, "is not an etcd client URL; give http://HOST:PORT"),
    ({"membership_endpoints": ["http://h:2379", "http://h:2379/"]}, "names an endpoint twice"),
])
def test_validation_errors_say_what_to_do(changes: dict, words: str) -> None:
    config = LaunchConfig(script=SCRIPT)
    for k, v in changes.items():
        setattr(config, k, v)
    with pytest.raises(InvalidOptionError) as info:
        config.validate()
    assert words in str(info.value)


def test_a_good_config_validates() -> None:
    LaunchConfig(script=SCRIPT, nproc_per_node=4, spares=2, nnodes=2, node_rank=1, coordinator="10.0.0.1:29400",
                 min_members=8).validate()


@pytest.mark.parametrize("changes", [
    {"nproc_per_node": 2, "min_members": 3},
    {"nproc_per_node": 1, "nnodes": 3, "node_rank": 1, "coordinator": "10.0.0.1:29400", "min_members": 4},
])
def test_min_members_above_the_jobs_world_size_is_rejected(changes: dict) -> None:
    config = LaunchConfig(script=SCRIPT, **changes)
    with pytest.raises(InvalidOptionError) as info:
        config.validate()
    assert "more than the job can ever have" in str(info.value) and f"give at most {config.world_size}" in str(
        info.value)


def test_min_members_may_exceed_the_nodes_slots_in_a_multi_node_job() -> None:
    LaunchConfig(script=SCRIPT, nproc_per_node=1, nnodes=3, node_rank=2, coordinator="10.0.0.1:29400",
                 min_members=3).validate()


@pytest.mark.parametrize("nnodes, nproc, expected", [(1, 1, 1), (1, 4, 1), (2, 1, 2), (2, 2, 3), (3, 1, 2),
                                                     (4, 2, 5)])
def test_default_min_members_is_one_on_one_node_and_a_majority_on_several(nnodes: int, nproc: int,
                                                                           expected: int) -> None:
    config = LaunchConfig(script=SCRIPT, nproc_per_node=nproc, nnodes=nnodes, node_rank=nnodes - 1,
                          coordinator=None if nnodes == 1 else "10.0.0.1:29400")
    config.validate()
    assert config.effective_min_members == expected
    env = worker_env(config, local_rank=0, restart=0, coordinator="10.0.0.1:29400", launch_id="x", environ={})
    assert env["FTC10D_MIN_MEMBERS"] == str(expected)


def test_worker_env_is_torchrun_compatible_and_parsed_by_the_bootstrap() -> None:
    config = LaunchConfig(script=SCRIPT, nproc_per_node=4, nnodes=2, node_rank=1, heartbeat_timeout=0.5,
                          min_members=3, token="s3cret", env={"EXTRA": "1"})
    env = worker_env(config, local_rank=2, restart=3, coordinator="10.1.2.3:29400", launch_id="abc",
                     environ={"PATH": "/bin", "FTC10D_TOKEN": "other"})
    expected = {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "FTC10D_RESTART_COUNT": "3", "FTC10D_COORDINATOR": "10.1.2.3:29400", "FTC10D_LAUNCH_ID": "abc",
        "FTC10D_HEARTBEAT_TIMEOUT": "0.5", "FTC10D_MIN_MEMBERS": "3", "FTC10D_TOKEN": "s3cret", "EXTRA": "1",
        "PATH": "/bin",
    }
    assert {k: env.get(k) for k in expected} == expected
    parsed = WorkerEnv.from_environ(env)  # what init_from_env will make of it
    assert (parsed.host, parsed.port, parsed.rank, parsed.world_size) == ("10.1.2.3", 29400, 6, 8)
    assert (parsed.launch_id, parsed.heartbeat_timeout, parsed.min_members) == ("abc", 0.5, 3)


def test_etcd_membership_reaches_the_worker_and_an_inherited_one_does_not() -> None:
    config = LaunchConfig(script=SCRIPT, membership_endpoints=["http://10.0.0.1:2379", "http://10.0.0.2:2379"])
    config.validate()
    env = worker_env(config, local_rank=0, restart=0, coordinator="127.0.0.1:29400", launch_id="abc",
                     environ={}, membership_prefix="/ftc10d/membership/abc/")
    parsed = WorkerEnv.from_environ(env)
    assert parsed.membership_endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert base_env(config, {})["FTC10D_MEMBERSHIP_ENDPOINTS"] == env["FTC10D_MEMBERSHIP_ENDPOINTS"], \
        "spares pre-import the etcd client when the job's membership is there"
    store = parsed.membership_store()
    assert store.kind == "etcd" and store.prefix == "/ftc10d/membership/abc/"
    stale = {"FTC10D_MEMBERSHIP_ENDPOINTS": "http://old:2379", "FTC10D_MEMBERSHIP_PREFIX": "/old/"}
    env = worker_env(LaunchConfig(script=SCRIPT), local_rank=0, restart=0, coordinator="127.0.0.1:29400",
                     launch_id="abc", environ=stale)
    assert WorkerEnv.from_environ(env).membership_store().kind == "tcp"
    with pytest.raises(InvalidOptionError, match="FTC10D_MEMBERSHIP_ENDPOINTS"):
        WorkerEnv.from_environ({**env, "FTC10D_MEMBERSHIP_ENDPOINTS": "etcd:2379"})


def test_no_token_means_none_in_the_environment() -> None:
    config = LaunchConfig(script=SCRIPT)
    env = worker_env(config, local_rank=0, restart=0, coordinator="127.0.0.1:1", launch_id="x", environ={})
    assert "FTC10D_TOKEN" not in env
    assert "RANK" not in base_env(config, {}), "spares must not get slot variables before promotion"


def test_scan_finds_top_level_imports_only_and_never_runs_the_script(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(
        "from __future__ import annotations\n"
        "import os, json as j\n"
        "import torch.nn.functional as F\n"
        "from collections import OrderedDict\n"
        "from . import sibling\n"
        "try:\n    import numpy\nexcept ImportError:\n    import array\n"
        "if os.name:\n    import csv\n"
        "def f():\n    import secret_inside_function\n"
        "class C:\n    import inside_class\n"
        f"open({str(marker)!r}, 'w').write('x')\n"
    )
    assert scan_imports(str(script)) == ["os", "json", "torch.nn.functional", "collections", "numpy", "array", "csv"]
    assert not marker.exists()
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    assert scan_imports(str(bad)) == []
    assert scan_imports(str(tmp_path / "missing.py")) == []


def test_cli_rejects_bad_options_with_a_hint() -> None:
    out = subprocess.run([sys.executable, "-m", "ftc10d", "launch", "--nproc-per-node", "0", SCRIPT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--nproc-per-node must be at least 1" in out.stderr


def test_cli_rejects_a_bad_etcd_endpoint_with_a_hint() -> None:
    out = subprocess.run([sys.executable, "-m", "ftc10d", "launch", "--membership-endpoints",
                          "http://127.0.0.1:2379,127.0.0.1:2381", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'127.0.0.1:2381' is not an etcd client URL; give http://HOST:PORT" in out.stderr, out.stderr


def test_ranks_sharing_a_gpu_get_distinct_nccl_host_ids_and_others_none() -> None:
    """NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected") unless their
    NCCL_HOSTID differ (issue 17): the launcher sets one per slot, keeping the host's name
    (ranks of different machines never look like one host) and a user's own value."""
    def ids(environ: dict, **changes: object) -> list:
        cfg = LaunchConfig(script=SCRIPT, nproc_per_node=3, **changes)  # type: ignore[arg-type]
        return [worker_env(cfg, local_rank=k, restart=0, coordinator="127.0.0.1:1", launch_id="x",
                           environ=environ).get("NCCL_HOSTID") for k in range(3)]

    shared = ids({}, gpus_per_node=1)
    assert len(set(shared)) == 3 and all(h is not None and h.endswith(f"-node0-slot{k}") for k, h in enumerate(shared))
    assert ids({"NCCL_HOSTID": "rackA"}, gpus_per_node=1, node_rank=0) == [f"rackA-node0-slot{k}" for k in range(3)]
    assert ids({}, gpus_per_node=3) == [None] * 3  # one GPU each: NCCL's default host id
    assert ids({}, gpus_per_node=0) == [None] * 3  # no GPU: no NCCL
    assert ids({"CUDA_VISIBLE_DEVICES": "0"}) == shared  # auto: one visible GPU, three ranks
    assert ids({"NCCL_HOSTID": "mine"}, gpus_per_node=4) == ["mine"] * 3  # not sharing: the user's, untouched
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == 1  # CUDA stops at the first invalid entry

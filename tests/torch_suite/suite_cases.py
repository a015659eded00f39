"""torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the torch
wheel) on a chosen backend: run by :mod:`tests.torch_suite.compare`, not by ``make test``
(its file name is not ``test_*.py``).

The suite reads ``BACKEND`` to decide what to expect; it is always ``gloo`` here, so that an
ftc10d group is held to *Gloo's* expectations (its semantics, its error messages). The group
the suite's processes actually create is ``FTC10D_SUITE_BACKEND`` (``gloo`` or ``ftc10d``):
``TestDistBackend._run`` is torch's, but for that one name. ``WORLD_SIZE`` and ``TEMP_DIR``
are torch's; the comparer sets them."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
from datetime import timedelta

os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ftc10d-torch-suite-"))
REAL_BACKEND = os.environ.get("FTC10D_SUITE_BACKEND", "gloo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ftc10d  # noqa: E402,F401 - registers the "ftc10d" backend in every spawned process
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


if REAL_BACKEND == "ftc10d":
    # torch's profiler checks run only for the backends it lists: hold ftc10d to them too
    # (its ``ftc10d:<op>`` events, ftc10d.pg.profiling), as NCCL's and Gloo's are.
    for _allowlist in (_dt.PROFILING_SUPPORTED_BACKENDS, _dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
                       _dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        _allowlist.append("ftc10d")


def _rank_main(cls: type, rank: int, test_name: str, file_name: str, pipe: object, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    cls._run(rank, test_name, file_name, pipe)


_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "ftc10d", __name__])


class TestTorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``TestDistBackendWithSpawn`` (test/distributed/test_distributed_spawn.py, which
    the wheel lacks), with the group made on ``FTC10D_SUITE_BACKEND``."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self) -> None:
        # torch's starts each rank with "spawn": a fresh interpreter importing torch and this
        # suite (~3 s of CPU per rank per test, most of a run's time on 2 cores). A forkserver
        # that imported them once starts the same `_run`, with this process's environment of
        # now (torch's setUp points TEMP_DIR at a new directory per test).
        self.processes = []
        for rank in range(int(self.world_size)):
            parent_conn, child_conn = torch.multiprocessing.Pipe()
            proc = _CTX.Process(target=_rank_main, name=f"process {rank}",
                                args=(type(self), rank, self._current_test_name(), self.file_name, child_conn,
                                      dict(os.environ)))
            proc.start()
            self.pid_to_pipe[proc.pid] = parent_conn
            self.processes.append(proc)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: object, **kwargs: object) -> None:
        # torch's TestDistBackend._run, the backend name aside
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        timeout = timedelta(seconds=_dt.CUSTOM_PG_TIMEOUT.get(test_name, _dt.default_pg_timeout))
        try:
            dist.init_process_group(init_method=self.init_method, backend=REAL_BACKEND,
                                    world_size=int(self.world_size), rank=self.rank, timeout=timeout)
        except RuntimeError as e:
            if "recompile" in e.args[0]:
                sys.exit(TEST_SKIPS["backend_unavailable"].exit_code)
            raise
        self._barrier()
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()

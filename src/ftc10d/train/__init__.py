"""Training that keeps going: a worker's bootstrap under ``ftc10d launch``, the
step-commit Manager, live state recovery for joiners, and DDP integration.

Composes ``pg/`` and ``membership/``; neither knows about this layer.
"""

from ftc10d.train.bootstrap import WorkerEnv, handle_key, init_from_env
from ftc10d.train.ddp import DistributedDataParallel, allreduce_hook
from ftc10d.train.manager import Manager
from ftc10d.train.optimizer import ManagedOptimizer
from ftc10d.train.state import StateFormatError

__all__ = [
    "init_from_env",
    "WorkerEnv",
    "handle_key",
    "Manager",
    "ManagedOptimizer",
    "DistributedDataParallel",
    "allreduce_hook",
    "StateFormatError",
]

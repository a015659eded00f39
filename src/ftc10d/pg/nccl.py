"""The NCCL adapter: one non-blocking ``ProcessGroupNCCL`` per configuration, cut by NCCL's abort.

Needs CUDA and a torch built with NCCL; for abort that returns, NCCL >= 2.14's non-blocking
communicators (``config.blocking = 0``) and torch >= 2.4's ``ProcessGroupNCCL.abort()``.
Measured on torch 2.11 / NCCL 2.28.9 (issue 17): abort 0.2-17 ms with a dead peer, ~0.5 s
with a frozen one.

Three traps of raw NCCL that this adapter and the generation above it hide:

- **torch's watchdog kills the survivors.** With ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's
  default), the watchdog tears the *surviving* processes down once a peer's death fails an op.
  The adapter sets it to 0 before creating the group (the generation aborts and types the
  error; nothing tears the process down) and logs if it overrode a user's value.
- **An aborted op's wait returns normally.** After ``abort()`` a pending work's ``wait()``
  returns as if it succeeded (its output is garbage). So ``cut_fails_ops`` is False: the
  generation marks every op not completed when the abort began as abandoned, and its waits
  and futures raise ``ProcessGroupAborted`` (``Generation.abort``).
- **A wait does not wait.** ``WorkNCCL.wait()`` only makes the current CUDA stream wait; a
  caller that went on would read an aborted op's garbage. ``poll_wait`` is True: ftc10d's
  ``Work.wait`` polls ``is_completed()`` (the op's CUDA event) on the CPU in short slices, so
  that an abort can fail it. This costs the CPU/GPU overlap of the wait, not the op.

Several ranks can share one GPU (tests on a one-GPU machine) only with a different
``NCCL_HOSTID`` each; ``ftc10d launch`` sets it when ranks share a GPU.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftc10d.pg.backend import Communicator, FailureKind
from ftc10d.types import InvalidOptionError

logger = logging.getLogger("ftc10d")

#: torch's watchdog must not tear a survivor down when a peer's death fails an op.
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: What NCCL's (and torch's NCCL) errors say when a peer died or a connection failed.
PEER_ERROR_MARKERS = ("ncclRemoteError", "remote process exited", "ncclSystemError", "Connection closed",
                      "Connection reset", "NCCL communicator was aborted")
TIMEOUT_MARKERS = ("timed out", "Timeout", "ran for")


def unavailable_reason() -> str:
    """Why an NCCL group cannot be made in this process ("" when it can)."""
    if not dist.is_nccl_available():
        return f"this torch ({torch.__version__}) is built without NCCL"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if not hasattr(dist.ProcessGroupNCCL, "abort"):
        return f"this torch ({torch.__version__}) has no ProcessGroupNCCL.abort(); ftc10d needs torch >= 2.4 for NCCL"
    return ""


class NcclUnavailableError(InvalidOptionError):
    """``backend="nccl"`` where NCCL cannot run; the message says why and what to use."""


class NcclCommunicator(Communicator):
    """One connected non-blocking ``ProcessGroupNCCL`` on this process's current CUDA device."""

    name = "nccl"
    device = "cuda"
    carries = frozenset({"cuda"})
    cut_fails_ops = False
    poll_wait = True

    @classmethod
    def unavailable(cls) -> str:
        why = unavailable_reason()
        return (f"backend 'nccl': {why}. Use backend='gloo' (it also carries CUDA tensors, through the host), "
                "or run where CUDA and NCCL are available") if why else ""

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> "NcclCommunicator":
        why = cls.unavailable()
        if why:
            raise NcclUnavailableError(why)
        return cls(store, rank, size, timeout)

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        old = os.environ.get(ASYNC_ERROR_HANDLING)
        if old not in (None, "0"):
            logger.warning("ftc10d: %s=%s would let torch's watchdog kill this process when a peer dies; set to 0 "
                           "for ftc10d's NCCL groups (ftc10d aborts the configuration instead)",
                           ASYNC_ERROR_HANDLING, old)
        os.environ[ASYNC_ERROR_HANDLING] = "0"  # read by each ProcessGroupNCCL at construction
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.config.blocking = 0  # non-blocking communicator: its abort returns (NCCL >= 2.14)
        self.rank, self.size = rank, size
        self.cuda_device = torch.device("cuda", torch.cuda.current_device())
        self.backend: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        # Connect now, inside the rendezvous that agreed on the members (lazily, the first op
        # would connect, and a member that died meanwhile would hang it rather than fail it).
        self.backend.eager_connect_single_device(self.cuda_device)

    def cut(self) -> int:
        try:
            self.backend.abort()
        except Exception:  # never raises (Communicator.cut); the generation abandons the ops anyway
            logger.exception("ftc10d: ProcessGroupNCCL.abort() failed")
            return 0
        return 1

    def classify(self, exc: BaseException) -> FailureKind:
        text = str(exc)
        if isinstance(exc, (TypeError, ValueError)):
            return FailureKind.REJECTED_ARGS
        if any(m in text for m in PEER_ERROR_MARKERS):
            return FailureKind.PEER_CLOSED
        if any(m in text for m in TIMEOUT_MARKERS):
            return FailureKind.TIMEOUT
        return FailureKind.OTHER

    def set_timeout(self, timeout: timedelta) -> None:
        setter = getattr(self.backend, "set_timeout", None) or getattr(self.backend, "_set_default_timeout", None)
        if setter is not None:
            setter(timeout)

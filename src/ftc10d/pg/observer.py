"""What the issue path tells an observer (the flight recorder), without knowing it.

``pg/`` sits below ``flight_recorder/``: the group calls an :class:`OpObserver`
that a higher layer installed, and reports an op's fate to the
:class:`OpRecord` the observer returned. Kept apart from the user's pre/post
hooks so that recording costs no hook-argument objects per op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import torch

from ftc10d.types import CollectiveError, CollectiveTimeoutError, PeerFailureError, ProcessGroupAborted

if TYPE_CHECKING:
    from ftc10d.pg.generation import Generation
    from ftc10d.pg.process_group import ProcessGroup


class OpRecord(Protocol):
    @property
    def settled(self) -> bool: ...

    def complete(self) -> None: ...

    def fail(self, error: str) -> None: ...


class OpObserver(Protocol):
    def on_generation(self, pg: "ProcessGroup", gen: "Generation") -> None: ...

    def on_issue(
        self,
        pg: "ProcessGroup",
        gen: "Generation",
        op: str,
        seq: int,
        p2p: bool,
        root: int,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        op_id: int,
    ) -> Optional[OpRecord]: ...


#: Called as ``fn(pg, flight_recorder_arg)`` at the end of every group's construction;
#: higher layers append to it to attach themselves to every group by default.
GROUP_CREATED: list[Callable[["ProcessGroup", Any], None]] = []


def error_kind(err: CollectiveError) -> str:
    if isinstance(err, CollectiveTimeoutError):
        return "timeout"
    if isinstance(err, PeerFailureError):
        return "peer failure"
    if isinstance(err, ProcessGroupAborted):
        return "aborted"
    return "communication error"

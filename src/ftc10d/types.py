"""Public types of ftc10d: torch 2.14's fault-tolerance contract, on any torch.

The names and members mirror torch 2.14 (``torch._C._distributed_c10d``) so that
code written for the native API keeps working. On torch 2.14 the hook argument
types and enums *are* torch's; on 2.13 they are Python twins defined here.

Every failure ftc10d raises derives from :class:`FTC10DError`, itself a
``torch.distributed.DistError`` so existing ``except DistError`` handlers keep
catching it. Failures of an operation carry ``op``, ``seq``, ``uuid`` and, when
known, the failed ``peer`` rank (invariant 4 of the design).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ftc10d import _compat

__all__ = [
    "ReconfigureOptions",
    "HookOpName",
    "PreHookArgs",
    "PostHookArgs",
    "ErrorType",
    "FTC10DError",
    "NotConfiguredError",
    "ReconfigureError",
    "InvalidHandleError",
    "DuplicateHandleError",
    "MissingHandleError",
    "UuidReusedError",
    "ConfigurationMismatchError",
    "ReconfigureAbandonedError",
    "ReconfigureConnectError",
    "ReconfigureTimeoutError",
    "InvalidOptionError",
    "CollectiveError",
    "ProcessGroupAborted",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "CommunicationError",
    "WindowAccessType",
    "WindowAttr",
    "PutOptions",
    "SignalOptions",
    "WaitSignalOptions",
    "WindowError",
    "WindowInvalidError",
    "WindowUsageError",
    "WindowNotRegisteredError",
    "WindowAlreadyRegisteredError",
    "WindowBoundsError",
    "WindowDtypeError",
    "WindowRankError",
    "MembershipError",
    "Fenced",
    "MembershipTimeoutError",
    "StateLostError",
    "EXIT_STOP_JOB",
    "StoreUnavailableError",
]


# --------------------------------------------------------------------------- enums

if _compat.TorchHookOpName is not None:
    HookOpName = _compat.TorchHookOpName
else:

    class HookOpName(enum.Enum):  # type: ignore[no-redef]
        """Which operation a pre/post hook sees (torch 2.14 members, same order)."""

        SEND = 0
        RECV = 1
        BROADCAST = 2
        ALLREDUCE = 3
        REDUCE = 4
        ALLGATHER = 5
        REDUCE_SCATTER = 6
        ALLTOALL = 7
        BARRIER = 8
        SCATTER = 9
        GATHER = 10
        SPLIT = 11
        NEW_WINDOW = 12
        UNKNOWN = 13


if _compat.TorchErrorType is not None:
    ErrorType = _compat.TorchErrorType
else:

    class ErrorType(enum.Enum):  # type: ignore[no-redef]
        """Last error of a group, as ``ProcessGroup.get_error()`` reports it."""

        SUCCESS = 0
        TIMEOUT = 1
        COMM_ERROR = 2
        REMOTE_ERROR = 3


# ----------------------------------------------------------------- hook arguments

if _compat.TorchPreHookArgs is not None:
    PreHookArgs = _compat.TorchPreHookArgs
    PostHookArgs = _compat.TorchPostHookArgs
else:

    @dataclass
    class PreHookArgs:  # type: ignore[no-redef]
        """What a pre-hook sees before an op is handed to the backend."""

        name: Any = None
        async_op: bool = False
        input_tensors: list[torch.Tensor] = field(default_factory=list)
        output_tensors: list[torch.Tensor] = field(default_factory=list)
        root: int = -1
        op_id: int = 0

    @dataclass
    class PostHookArgs:  # type: ignore[no-redef]
        """What a post-hook sees once the op was issued (not completed)."""

        name: Any = None
        async_op: bool = False
        work: Optional[dist.Work] = None
        op_id: int = 0


def make_pre_hook_args(
    name: Any,
    async_op: bool,
    input_tensors: list[torch.Tensor],
    output_tensors: list[torch.Tensor],
    root: int,
    op_id: int,
) -> Any:
    """Build a ``PreHookArgs`` of whichever class is in use (torch's has no kwargs ctor)."""
    args = PreHookArgs()
    args.name = name
    args.async_op = async_op
    args.input_tensors = input_tensors
    args.output_tensors = output_tensors
    args.root = root
    args.op_id = op_id
    return args


def make_post_hook_args(name: Any, async_op: bool, work: Optional[dist.Work], op_id: int) -> Any:
    args = PostHookArgs()
    args.name = name
    args.async_op = async_op
    args.work = work
    args.op_id = op_id
    return args


# ------------------------------------------------------------------ window types

if _compat.TorchWindowAccessType is not None:
    WindowAccessType = _compat.TorchWindowAccessType
    WindowAttr = _compat.TorchWindowAttr
else:

    class WindowAccessType(enum.Enum):  # type: ignore[no-redef]
        """How a peer's window is reached: UNIFIED (mapped, one coherent copy) or
        SEPARATE (a distinct copy reached by messages)."""

        UNIFIED = 0
        SEPARATE = 1

    @dataclass
    class WindowAttr:  # type: ignore[no-redef]
        """What ``Window.get_attr(peer)`` reports."""

        access_type: Any = WindowAccessType.UNIFIED


def make_window_attr(access_type: Any) -> Any:
    attr = WindowAttr()
    attr.access_type = access_type
    return attr


if _compat.TorchPutOptions is not None:
    PutOptions = _compat.TorchPutOptions
    SignalOptions = _compat.TorchSignalOptions
    WaitSignalOptions = _compat.TorchWaitSignalOptions
else:
    # torch's default timeout is -1 ms, meaning "the group's timeout"; so is ours.

    @dataclass
    class PutOptions:  # type: ignore[no-redef]
        """Options of ``Window.put`` (same fields as torch 2.14's)."""

        timeout: timedelta = timedelta(milliseconds=-1)
        hints: dict[str, str] = field(default_factory=dict)

    @dataclass
    class SignalOptions:  # type: ignore[no-redef]
        """Options of ``Window.signal`` (same fields as torch 2.14's)."""

        timeout: timedelta = timedelta(milliseconds=-1)
        hints: dict[str, str] = field(default_factory=dict)

    @dataclass
    class WaitSignalOptions:  # type: ignore[no-redef]
        """Options of ``Window.wait_signal`` (same fields as torch 2.14's)."""

        timeout: timedelta = timedelta(milliseconds=-1)
        hints: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------ reconfigure options


@dataclass
class ReconfigureOptions:
    """Arguments of ``ProcessGroup.reconfigure`` (same fields as torch 2.14's).

    ``uuid`` identifies this instance of the communicator and must never have
    been used before on the same store. ``handles`` lists one handle per member:
    a ``list`` assigns ranks by position; a ``set`` assigns them in sorted order
    of the handle strings, which every member computes identically.
    ``timeout`` bounds the rendezvous (``None``: the group's timeout).
    """

    uuid: int
    handles: Union[list[str], set[str], frozenset[str], tuple[str, ...]]
    timeout: Optional[timedelta] = None
    hints: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------- exceptions


class FTC10DError(dist.DistError):
    """Base of every error ftc10d raises."""


class NotConfiguredError(FTC10DError):
    """An operation was issued before the group had a configuration."""


class InvalidOptionError(FTC10DError, ValueError):
    """An argument or option was not understood (unknown hint, wrong type...)."""


class CollectiveMismatchError(InvalidOptionError):
    """Ranks called different collectives (op, shapes, dtypes, root or reduce op) at the
    same point; found by the collective check (``check_collectives=True``) before any
    data moved, so the group keeps its configuration and stays usable.
    ``signatures`` maps each rank to what it called."""

    def __init__(
        self, message: str, *, op: str, seq: int, uuid: Optional[int], signatures: dict[int, str]
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.uuid = uuid
        self.signatures = signatures


class ReconfigureError(FTC10DError):
    """``reconfigure()`` failed; the group keeps its previous configuration
    when the failure was detected before the previous one was aborted."""


class InvalidHandleError(ReconfigureError, ValueError):
    """A reconfigure handle is malformed, or the handle list is empty."""


class DuplicateHandleError(ReconfigureError, ValueError):
    """The same handle appears twice in one handle list."""


class MissingHandleError(ReconfigureError, ValueError):
    """This group's own handle is not in the handle list it was given."""


class UuidReusedError(ReconfigureError, ValueError):
    """The uuid was used before for a configuration on this store."""


class ConfigurationMismatchError(ReconfigureError):
    """Members were given different handle lists for the same uuid."""


class ReconfigureTimeoutError(ReconfigureError, TimeoutError):
    """Not every member reached the rendezvous within the timeout.

    ``missing_handles``: the handles of the ranks that did not arrive, so that a caller
    can tell a member that keeps not coming from one that was late once."""

    def __init__(self, message: str, missing_handles: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing_handles = tuple(missing_handles)


class ReconfigureConnectError(ReconfigureError):
    """Every member arrived at the rendezvous, but connecting the new communicator failed
    (a member died or froze in between). Nothing usable was built; reconfigure again with
    the members that are alive (a fresh uuid)."""


class ReconfigureAbandonedError(ReconfigureError):
    """The rendezvous was given up before every member arrived: this group was
    aborted while it waited (its membership moved on to a newer configuration),
    or another member gave it up. Nothing was connected; reconfigure again with
    the newest configuration (a fresh uuid)."""


class CollectiveError(FTC10DError):
    """An operation failed. Names the op, its sequence number in its generation,
    the generation uuid and, when known, the failed peer's rank."""

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        seq: int = -1,
        uuid: Optional[int] = None,
        peer: Optional[int] = None,
        error_type: Any = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.uuid = uuid
        self.peer = peer
        self.error_type = error_type


class ProcessGroupAborted(CollectiveError):
    """The configuration the op belonged to was aborted (explicitly, by a
    timeout, by a peer failure or by ``reconfigure``)."""


class ParentReconfiguredError(ProcessGroupAborted):
    """The group is a sub-group (``new_group``, ``new_subgroups``, a DeviceMesh dimension)
    of an ftc10d group that was reconfigured since: its ranks were those of the parent's
    old configuration, so it was aborted. Create it again, on every member of the
    parent's new configuration (e.g. call ``init_device_mesh`` again)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """The op did not complete within its timeout; its configuration was aborted."""


class PeerFailureError(CollectiveError):
    """A peer closed or reset its connection (it died or aborted); the
    configuration was aborted."""


class CommunicationError(CollectiveError):
    """The backend failed the op for a local reason; the configuration was aborted."""


# ----------------------------------------------------------------- window errors


class WindowError(FTC10DError):
    """Base of the errors of one-sided windows (``ProcessGroup.new_window``)."""


class WindowInvalidError(WindowError, ProcessGroupAborted):
    """The window's configuration was aborted or replaced (reconfigure, abort,
    a peer's failure): a window belongs to one generation and dies with it.
    Create a new window on the reconfigured group."""


class WindowUsageError(WindowError, InvalidOptionError):
    """A window op was called wrongly; nothing was sent and the window is intact."""


class WindowNotRegisteredError(WindowUsageError):
    """``put``/``map_remote_tensor`` before ``tensor_register`` (or after ``tensor_deregister``)."""


class WindowAlreadyRegisteredError(WindowUsageError):
    """``tensor_register`` on a window that already has a tensor."""


class WindowBoundsError(WindowUsageError, IndexError):
    """A put does not fit in the destination's window."""


class WindowDtypeError(WindowUsageError, TypeError):
    """A put's dtype differs from the destination window's dtype."""


class WindowRankError(WindowUsageError):
    """A peer rank that is not a rank of the window's configuration."""

# ------------------------------------------------------------------ membership


class MembershipError(FTC10DError):
    """A failure of the membership layer (``ftc10d.membership``)."""


class Fenced(MembershipError):
    """This member was removed from the membership (it was frozen, partitioned,
    reported dead, or superseded by a rejoin of the same process) and a later
    configuration excludes it. It can never take part again under this identity:
    create a new member (``Member.rejoin()``) to be admitted at a later epoch.

    ``epoch`` is the first configuration that excludes this member; ``member_id``
    the fenced identity."""

    def __init__(self, message: str, *, member_id: str = "", epoch: Optional[int] = None) -> None:
        super().__init__(message)
        self.member_id = member_id
        self.epoch = epoch


class MembershipTimeoutError(MembershipError, TimeoutError):
    """No (next) configuration was agreed in time. The message says why
    (``status``): e.g. below ``min_members``, no majority, store unreachable."""

    def __init__(self, message: str, *, status: Any = None) -> None:
        super().__init__(message)
        self.status = status


#: A worker that exits with this code stops the whole job instead of being respawned by
#: ``ftc10d launch``: the job itself cannot go on (``ReplicaDivergenceError``: a replacement would
#: only receive a wrong state; ``StateLostError``: nobody holds the state to train on). The
#: launcher stops the other workers and exits with it. ``ftc10d.train.init_from_env`` makes an
#: uncaught error of those two exit with it.
EXIT_STOP_JOB = 86


class StateLostError(MembershipError):
    """No live member holds the job's newest committed state (its identity is recorded with
    the membership, ``ftc10d.train.progress``), and none came back within the Manager's
    ``sync_timeout``: every member that held it is gone. Training on from scratch or from an
    older state would silently throw committed steps away or redo them (a second history);
    restore from a checkpoint or restart the job."""


class JobFinished(MembershipError):
    """The job finished while this process was out of it: the members that held its most
    advanced committed state closed (``Manager.close()``) at that step, and this process
    (a fenced member rejoining, or a replacement started late) holds an older state or
    none. There is nothing left to train and nobody to catch up from: exit with status 0.

    ``step`` is the step the job finished at; ``held`` the step this process holds (-1:
    none)."""

    def __init__(self, message: str, *, step: int = -1, held: int = -1) -> None:
        super().__init__(message)
        self.step = step
        self.held = held


class ReplicaDivergenceError(FTC10DError):
    """Replicas that should hold bitwise-identical state do not: their state fingerprints,
    compared across the group (in the commit vote every ``check_every`` steps, and after
    every configuration change), differ. Training on would silently average gradients of
    different models, so every rank of the group raises this at the same step instead.

    ``step`` is the committed step the fingerprints describe; ``groups`` maps each distinct
    fingerprint to the ranks (of the current configuration) that hold it; ``ranks`` lists
    the ranks outside the largest group (the likely divergent ones; with a tie, all but
    the group of the lowest rank); ``members`` their membership ids (ranks change from one
    configuration to the next, member ids do not)."""

    def __init__(self, message: str, *, step: int = -1, groups: Optional[dict[str, list[int]]] = None,
                 ranks: Optional[list[int]] = None, members: Optional[list[str]] = None) -> None:
        super().__init__(message)
        self.step = step
        self.groups = dict(groups or {})
        self.ranks = list(ranks or [])
        self.members = list(members or [])


class StoreUnavailableError(MembershipError, ConnectionError):
    """The membership store could not be reached (all endpoints tried)."""

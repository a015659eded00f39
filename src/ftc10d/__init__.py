"""ftc10d: PyTorch distributed training that survives the loss of a rank, in place.

The process group implements torch 2.14's fault-tolerance contract
(``supports_reconfigure``, ``get_reconfigure_handle()``, ``reconfigure()``,
abort/pre/post hooks, one-sided windows) on torch 2.13 and 2.14 alike, over
Gloo, with an ``abort()`` that really unblocks pending operations.
"""

import logging

from ftc10d.pg import (
    ProcessGroup,
    Work,
    get_reconfigure_handle,
    init_process_group,
    reconfigure,
    supports_reconfigure,
)
from ftc10d.types import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicationError,
    ConfigurationMismatchError,
    DuplicateHandleError,
    ErrorType,
    Fenced,
    FTC10DError,
    HookOpName,
    InvalidHandleError,
    InvalidOptionError,
    MembershipError,
    MembershipTimeoutError,
    MissingHandleError,
    NotConfiguredError,
    PeerFailureError,
    PostHookArgs,
    PreHookArgs,
    ProcessGroupAborted,
    ReconfigureError,
    ReconfigureOptions,
    ReconfigureAbandonedError,
    ReconfigureTimeoutError,
    StoreUnavailableError,
    UuidReusedError,
    PutOptions,
    SignalOptions,
    WaitSignalOptions,
    WindowAccessType,
    WindowAlreadyRegisteredError,
    WindowAttr,
    WindowBoundsError,
    WindowDtypeError,
    WindowError,
    WindowInvalidError,
    WindowNotRegisteredError,
    WindowRankError,
    WindowUsageError,
)

from ftc10d import flight_recorder  # noqa: E402  (attaches itself to every new group)

__version__ = "0.1.0"

logging.getLogger("ftc10d").addHandler(logging.NullHandler())

__all__ = [
    "ProcessGroup",
    "Work",
    "init_process_group",
    "get_reconfigure_handle",
    "reconfigure",
    "supports_reconfigure",
    "ReconfigureOptions",
    "HookOpName",
    "PreHookArgs",
    "PostHookArgs",
    "ErrorType",
    "FTC10DError",
    "NotConfiguredError",
    "InvalidOptionError",
    "ReconfigureError",
    "InvalidHandleError",
    "DuplicateHandleError",
    "MissingHandleError",
    "UuidReusedError",
    "ConfigurationMismatchError",
    "ReconfigureAbandonedError",
    "ReconfigureTimeoutError",
    "CollectiveError",
    "ProcessGroupAborted",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "CommunicationError",
    "flight_recorder",
    "PutOptions",
    "SignalOptions",
    "WaitSignalOptions",
    "WindowAccessType",
    "WindowAlreadyRegisteredError",
    "WindowAttr",
    "WindowBoundsError",
    "WindowDtypeError",
    "WindowError",
    "WindowInvalidError",
    "WindowNotRegisteredError",
    "WindowRankError",
    "WindowUsageError",
    "MembershipError",
    "Fenced",
    "MembershipTimeoutError",
    "StoreUnavailableError",
    "__version__",
]

"""Version shims: one place that knows which torch we run on.

torch 2.14 ships the fault-tolerance types (``HookOpName``, ``PreHookArgs``,
``PostHookArgs``, ``ErrorType``, ``ReconfigureOptions``) in C++; torch 2.13 has
none of them. Where torch has a type we hand users torch's own, so a hook written
against torch 2.14 (``args.name == HookOpName.ALLREDUCE``) behaves the same on
an ftc10d group; where it does not, ftc10d supplies a Python twin with the same
members and fields.
"""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as _c10d

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

TorchHookOpName = getattr(_c10d, "HookOpName", None)
TorchPreHookArgs = getattr(_c10d, "PreHookArgs", None)
TorchPostHookArgs = getattr(_c10d, "PostHookArgs", None)
TorchErrorType = getattr(_c10d, "ErrorType", None)
TorchReconfigureOptions = getattr(_c10d, "ReconfigureOptions", None)
TorchWindowAccessType = getattr(_c10d, "WindowAccessType", None)
TorchWindowAttr = getattr(_c10d, "WindowAttr", None)
TorchPutOptions = getattr(_c10d, "PutOptions", None)
TorchSignalOptions = getattr(_c10d, "SignalOptions", None)
TorchWaitSignalOptions = getattr(_c10d, "WaitSignalOptions", None)

HAS_NATIVE_RECONFIGURE: bool = TorchReconfigureOptions is not None

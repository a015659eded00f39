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


def work_exception(work: object) -> "BaseException | None":
    """``work.exception()`` of a backend work, on every torch we support.

    torch 2.11's binding of ``Work.exception()`` cannot convert its return value
    (``std::exception_ptr``) and raises ``TypeError`` whatever the work did. There the
    error comes from the work's future (which holds the backend's exception), or, for a
    work without one (Gloo's send/recv), from ``is_success()``."""
    try:
        return work.exception()  # type: ignore[attr-defined]
    except TypeError:
        pass
    if not work.is_completed():  # type: ignore[attr-defined]
        return None
    try:
        fut = work.get_future()  # type: ignore[attr-defined]
    except Exception:
        fut = None
    if fut is not None and fut.done():
        try:
            fut.value()
            return None
        except Exception as exc:  # noqa: BLE001 - the work's own error, returned
            return exc
    try:
        ok = bool(work.is_success())  # type: ignore[attr-defined]
    except Exception:
        ok = True
    return None if ok else RuntimeError("the backend op failed (this torch's Work.exception() cannot say why)")

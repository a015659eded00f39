"""Helpers of the FT-HSDP tests."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def digest(state: dict[str, Any]) -> str:
    """A short hash of a rank's local state (``ftc10d.train.fsdp.local_state``): its model
    and optimizer tensors' bytes, by name; equal on two ranks iff (almost surely) bitwise equal."""
    h = hashlib.sha256()
    for part in ("model", "optim"):
        for name in sorted(state.get(part, {})):
            v = state[part][name]
            for k in sorted(v) if isinstance(v, dict) else [None]:
                t = v[k] if k is not None else v
                h.update(f"{part}/{name}/{k}".encode())
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

"""torchtitan on a machine without a GPU: what must change before torchtitan is imported.

torchtitan targets CUDA. Four things stop its llama3 trainer on CPU (found on torchtitan
0.3.0, torch 2.13-2.15); each is replaced here in this process only, nothing on disk:

1. **Device.** ``torchtitan.tools.utils`` picks ``device_type = ... or "cuda"`` when it is
   imported, and many modules bind ``device_type``/``device_module`` by name then: we set
   ``cpu`` and a device-module stand-in (``torch.cpu`` plus the CUDA-style memory and
   property calls its metrics make) before any of them is imported.
2. **FlexAttention has no backward on CPU.** Its forward becomes
   ``scaled_dot_product_attention`` with the dense mask of the batch's ``BlockMask``
   (``mask_mod`` on the full grid; cached against the mask object itself, held and
   compared with ``is``: an ``id`` can be reused once the old mask is collected).
3. **Gloo refuses PREMUL_SUM**, which FSDP2 reduce-scatters with when torchtitan sets a
   gradient divide factor of 1.0: every FSDP module also gets
   ``set_force_sum_reduction_for_comms(True)`` (SUM, then a division by 1.0: the same numbers).
4. **torch < 2.14 has no ``dist.set_timeout``**, which torchtitan calls after the first step:
   torch's per-group ``_set_pg_timeout`` instead.

Call :func:`apply` first thing in the process (``ftc10d.integrations.torchtitan.train``
does when CUDA is absent or ``FTC10D_TITAN_DEVICE=cpu``).
"""

from __future__ import annotations

import logging
import os
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftc10d.types import InvalidOptionError

logger = logging.getLogger("ftc10d")

_applied = False
_TOO_LATE = ("torchtitan.trainer", "torchtitan.distributed.utils", "torchtitan.components.metrics")


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls torchtitan makes on its device module."""

    def __init__(self) -> None:
        super().__init__("ftc10d_torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _DenseMask:
    """The dense boolean mask of the last ``BlockMask`` seen (one per batch, shared by the layers)."""

    def __init__(self) -> None:
        self.block_mask: Any = None
        self.dense: Any = None

    def __call__(self, block_mask: Any) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_mask

        if self.block_mask is not block_mask:
            b, _, q_len, kv_len = block_mask.shape
            self.dense = create_mask(block_mask.mask_mod, b, 1, q_len, kv_len, device="cpu")
            self.block_mask = block_mask
        return self.dense


def apply() -> None:
    """Make torchtitan run on CPU (module docstring); idempotent. Raises
    :class:`InvalidOptionError` if torchtitan's trainer was imported already."""
    global _applied
    if _applied:
        return
    loaded = [m for m in _TOO_LATE if m in sys.modules]
    if loaded:
        raise InvalidOptionError(f"ftc10d.integrations.torchtitan.cpu.apply() must run before torchtitan's trainer is "
                                 f"imported ({', '.join(loaded)} already are): call it first thing in the process")
    import torchtitan.tools.utils as tt_utils

    device = _CpuDeviceModule()
    tt_utils.device_type = "cpu"
    tt_utils.device_module = device
    tt_utils.get_device_info = lambda: ("cpu", device)
    tt_utils.get_local_device = lambda: torch.device("cpu")

    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as tt_attn
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask

    dist_utils.get_local_device = tt_utils.get_local_device

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        dist.barrier()
        groups: list[Any] = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in groups + [None]:
            if hasattr(dist, "set_timeout"):
                dist.set_timeout(timeout, group)
            else:
                from torch.distributed.distributed_c10d import _set_pg_timeout

                try:
                    _set_pg_timeout(timeout, group)
                except Exception as exc:  # noqa: BLE001 - a degree-1 fake group has no backend to time
                    logger.debug("torchtitan on cpu: no timeout set on %s: %s", group, exc)

    dist_utils.set_pg_timeouts = set_pg_timeouts

    divide = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        divide(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_and_sum

    tt_attn._compiled_create_block_mask = create_block_mask  # eager: no inductor on CPU
    dense = _DenseMask()

    def sdpa_forward(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: Any,
                     score_mod: Any = None, scale: Any = None, enable_gqa: bool = False, out_transform: Any = None,
                     **_: Any) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise InvalidOptionError("torchtitan on cpu: FlexAttention's score_mod/out_transform have no CPU stand-in")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(attention_masks), scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    tt_attn.FlexAttention.forward = sdpa_forward
    _applied = True
    logger.info("torchtitan adapted to cpu (device, attention, FSDP2 SUM reduce-scatter, group timeouts)")

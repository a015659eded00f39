"""The fault-tolerant process group layer (knows nothing of membership or training)."""

from ftc10d.pg.c10d import get_reconfigure_handle, init_process_group, reconfigure, supports_reconfigure
from ftc10d.pg.process_group import ProcessGroup
from ftc10d.pg import debug as _debug
from ftc10d.pg import torch_hooks as _torch_hooks
from ftc10d.pg.observer import GROUP_CREATED as _GROUP_CREATED
from ftc10d.pg.subgroups import register_backend as _register_backend
from ftc10d.pg.work import Work

# "ftc10d" as a torch backend name: dist.new_group / new_subgroups / init_device_mesh on an
# ftc10d default group make ftc10d groups (ftc10d.pg.subgroups).
_register_backend()
# torch's NanCheckHook / FlightRecorderHook / TORCH_DIST_NAN_CHECK on ftc10d groups
# (ftc10d.pg.torch_hooks).
_torch_hooks.install()
_GROUP_CREATED.append(_torch_hooks.on_group_created)
# dist.monitored_barrier on ftc10d groups (ftc10d.pg.debug).
_debug.install()

__all__ = [
    "ProcessGroup",
    "Work",
    "init_process_group",
    "get_reconfigure_handle",
    "reconfigure",
    "supports_reconfigure",
]

"""The fault-tolerant process group layer (knows nothing of membership or training)."""

from ftc10d.pg.c10d import get_reconfigure_handle, init_process_group, reconfigure, supports_reconfigure
from ftc10d.pg.process_group import ProcessGroup
from ftc10d.pg.work import Work

__all__ = [
    "ProcessGroup",
    "Work",
    "init_process_group",
    "get_reconfigure_handle",
    "reconfigure",
    "supports_reconfigure",
]

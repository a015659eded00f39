"""One-sided RMA windows (``put`` / ``signal`` / ``wait_signal`` / ``map_remote_tensor``)
on ftc10d groups: shared memory between processes of one host, TCP across hosts.

Depends only on ``ftc10d.pg`` and ``ftc10d.types``. Created with
``ProcessGroup.new_window(tensor=None)``.
"""

from ftc10d.window._resources import TRANSPORT_ENV
from ftc10d.window.window import Window, new_window
from ftc10d.window.work import WindowWork

__all__ = ["Window", "WindowWork", "new_window", "TRANSPORT_ENV"]

"""``ftc10d launch``: a torchrun-like supervisor that replaces only the worker that died.

- ``config.py``: :class:`LaunchConfig` and its validation
- ``env.py``: the workers' environment (torchrun's variables + ftc10d's)
- ``spare.py``: the warm-spare process (``python -m ftc10d.launch.spare``)
- ``supervisor.py``: :class:`Launcher` and :class:`LaunchEvent`
"""

from ftc10d.launch.config import LaunchConfig
from ftc10d.launch.supervisor import EXIT_STOP_JOB, LaunchEvent, Launcher, run

__all__ = ["LaunchConfig", "LaunchEvent", "Launcher", "run", "EXIT_STOP_JOB"]

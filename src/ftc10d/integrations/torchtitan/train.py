"""Run torchtitan's trainer on ftc10d, under ``ftc10d launch`` (a script, run by its path)::

    ftc10d launch --nproc-per-node 4 $(python -m ftc10d.integrations.torchtitan --script) \\
        --module ftc10d.integrations.torchtitan --config llama3_debugmodel --ftc10d.replicas 2 [torchtitan flags]

Without CUDA (or with ``FTC10D_TITAN_DEVICE=cpu``) torchtitan is first adapted to CPU
(:mod:`ftc10d.integrations.torchtitan.cpu`). Then torchtitan's own ``main()`` runs: its CLI,
its config, its trainer -- the one ``--module``/``--config`` name, here ftc10d's.
"""

from __future__ import annotations

import os

import torch


def main() -> None:
    if os.environ.get("FTC10D_TITAN_DEVICE") == "cpu" or not torch.cuda.is_available():
        from ftc10d.integrations.torchtitan import cpu

        cpu.apply()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()

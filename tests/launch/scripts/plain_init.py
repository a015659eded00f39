"""A launcher test worker that is a plain torch.distributed script: the default ``env://``
rendezvous under ``ftc10d launch`` (every rank a client of the launcher's store, as of
torchrun's agent store: ``TORCHELASTIC_USE_AGENT_STORE``).

``plain_init.py BACKEND`` ("ftc10d" or "gloo"): ``init_process_group(BACKEND)``, an all_reduce
whose sum it checks, ``destroy_process_group()``; exits 0 and prints one line if all went right.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ftc10d  # registers the "ftc10d" backend


def main() -> int:
    backend = sys.argv[1]
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    if (backend == "ftc10d") != isinstance(dist.group.WORLD, ftc10d.ProcessGroup):
        print(f"plain_init: the default group of backend {backend} is a {type(dist.group.WORLD)}", file=sys.stderr)
        return 1
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if t.item() != world * (world + 1) / 2:
        print(f"plain_init: rank {rank}: all_reduce gave {t.item()}", file=sys.stderr)
        return 1
    dist.destroy_process_group()
    print(f"plain_init: rank {rank} of {world}: all_reduce {t.item()} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's model and data: an MLP student learning a fixed random teacher.

Nothing is downloaded: a "teacher" network with fixed random weights labels
random inputs, so the student's loss really falls. Every rank derives the same
global batch of a step from the step number alone (so a replacement or a
survivor that takes over a different shard needs no data state) and trains on
its shard of it.
"""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 64, 640, 16  # ~0.46 M parameters in the student
GLOBAL_BATCH = 128
TEACHER_SEED = 1234


def make_student(seed: int = 0) -> nn.Module:
    """The model being trained (seed only matters for the first configuration: ranks
    start from different weights on purpose, the recovery makes them equal)."""
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, OUT))


def make_teacher() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(TEACHER_SEED)
        net = nn.Sequential(nn.Linear(IN, 128), nn.Tanh(), nn.Linear(128, OUT))
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_for(teacher: nn.Module, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard (of ``world``) of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    with torch.no_grad():
        y = teacher(x)
    return x[rank::world], y[rank::world]


def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred, target)

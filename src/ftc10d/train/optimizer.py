"""``ManagedOptimizer``: an optimizer whose ``step()`` applies only committed steps.

The two calls of the step-commit protocol (:mod:`ftc10d.train.manager`) at the two
places a training loop already has: ``zero_grad()`` begins the step, ``step()`` votes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ftc10d.train.manager import Manager


class ManagedOptimizer:
    """An optimizer whose ``step()`` applies only committed steps.

    ``zero_grad()`` starts the step (:meth:`Manager.start_step`); ``step()`` votes
    (:meth:`Manager.should_commit`) and applies the update only if it committed,
    returning whether it did. The wrapped optimizer is registered as state "optim"
    unless it is registered already.
    """

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer) -> None:
        self.manager = manager
        self.optimizer = optimizer
        if not manager.registered(optimizer):
            manager.register("optim", optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None, *, ok: bool = True) -> bool:
        if not self.manager.should_commit(ok):
            return False
        self.optimizer.step(closure)
        return True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

"""``--module ftc10d.integrations.torchtitan --config <name>``: torchtitan's configs on
:class:`FaultTolerantTrainer` (every field of torchtitan's own config, plus ``--ftc10d.*``)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torchtitan.trainer import Trainer

from ftc10d.integrations.torchtitan.trainer import FaultTolerantTrainer


def fault_tolerant(config: Any) -> FaultTolerantTrainer.Config:
    """torchtitan's ``Trainer.Config`` as a :class:`FaultTolerantTrainer` config."""
    return FaultTolerantTrainer.Config(**{f.name: getattr(config, f.name) for f in fields(Trainer.Config) if f.init})


def llama3_debugmodel() -> FaultTolerantTrainer.Config:
    """torchtitan's llama3 ``debugmodel`` (6.2 M parameters) on FT-HSDP."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as base

    return fault_tolerant(base())


def llama3_8b() -> FaultTolerantTrainer.Config:
    """torchtitan's llama3 8B on FT-HSDP."""
    from torchtitan.models.llama3.config_registry import llama3_8b as base

    return fault_tolerant(base())

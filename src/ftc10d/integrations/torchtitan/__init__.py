"""torchtitan on ftc10d's FT-HSDP (``pip install 'ftc10d[torchtitan]'``).

``--module ftc10d.integrations.torchtitan --config llama3_debugmodel`` (or ``llama3_8b``)
selects :class:`~ftc10d.integrations.torchtitan.trainer.FaultTolerantTrainer`: torchtitan's
trainer, model, data loader, optimizer, LR scheduler, checkpointer and metrics, with the
replicas of HSDP made fault-tolerant by ftc10d. Run it under ``ftc10d launch`` with the script
``python -m ftc10d.integrations.torchtitan --script`` prints. Nothing here is imported by
``import ftc10d``; torchtitan is imported only by this package.
"""

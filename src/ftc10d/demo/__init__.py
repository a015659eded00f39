"""``ftc10d demo``: a real (small) DDP job under faults, watched live.

Four workers train an MLP on teacher data through ftc10d (``model``, ``worker``);
the driver (``driver``) launches them with :mod:`ftc10d.launch`, injects the
fault schedule (``faults``), tails the workers' JSONL event files for the live
view (``live``), and at the end writes ``report.json`` (``report``) and a
timeline picture (``plot``). ``bench`` compares the same job with plain torch DDP
and with a torchrun restart (``ftc10d bench recovery``).
"""

"""``ftc10d chaos``: randomized faults on a real training job, with the invariants checked after every trial.

- :mod:`~ftc10d.chaos.schedule`  fault kinds, seeded schedules, replay files
- :mod:`~ftc10d.chaos.job`       the training script the launcher runs (writes event files)
- :mod:`~ftc10d.chaos.trial`     one trial: launch, inject, tear down, check
- :mod:`~ftc10d.chaos.checks`    invariants 1 and 3, stalls, leftover processes / shm / ports
- :mod:`~ftc10d.chaos.netns`     hosts as network namespaces, a link to cut
- :mod:`~ftc10d.chaos.runner`    many trials, the summary (``summary.json``)
"""

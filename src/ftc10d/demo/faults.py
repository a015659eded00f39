"""The fault schedule of ``ftc10d demo --faults``: ``kill:1@30,freeze:2@70:2.5``.

Each item is ``KIND:SLOT@STEP[:SECONDS]``:

- ``kill:S@N``       SIGKILL the worker of slot S once the job committed step N
  (a warm spare replaces it: that is the "join" of the report);
- ``freeze:S@N:D``   SIGSTOP it at step N and SIGCONT it D seconds later (default 2.5);
  past the heartbeat timeout it is removed, and when it resumes it finds itself
  fenced, rejoins and receives the state again.

``none`` (or an empty string) is the empty schedule.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Optional

from ftc10d.types import InvalidOptionError

KINDS = ("kill", "freeze")
DEFAULT_FREEZE_S = 2.5
_ITEM = re.compile(r"^(?P<kind>[a-z]+):(?P<slot>-?\d+)@(?P<step>-?\d+)(?::(?P<secs>[0-9.]+))?$")


class FaultScheduleError(InvalidOptionError):
    """A ``--faults`` value that cannot be used; the message says what to write instead."""


@dataclass(frozen=True)
class Fault:
    kind: str          # "kill" | "freeze"
    slot: int
    at_step: int
    duration: Optional[float] = None  # freeze only: seconds between SIGSTOP and SIGCONT

    def __str__(self) -> str:
        tail = f":{self.duration:g}" if self.kind == "freeze" else ""
        return f"{self.kind}:{self.slot}@{self.at_step}{tail}"


def parse_schedule(text: Optional[str], *, world_size: int, steps: int) -> list[Fault]:
    """Parse and check a schedule against the job; returns the faults ordered by step.

    Raises :class:`FaultScheduleError` naming the bad item and what is expected.
    """
    if text is None or text.strip().lower() in ("", "none"):
        return []
    out: list[Fault] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise FaultScheduleError(f"--faults {text!r}: empty item (stray comma?); "
                                     "expected e.g. kill:1@30,freeze:2@70:2.5")
        m = _ITEM.match(item.lower())
        if m is None:
            raise FaultScheduleError(f"--faults item {item!r} is not KIND:SLOT@STEP[:SECONDS] "
                                     "(e.g. kill:1@30 or freeze:2@70:2.5)")
        kind, slot, step, secs = m["kind"], int(m["slot"]), int(m["step"]), m["secs"]
        if kind not in KINDS:
            raise FaultScheduleError(f"--faults item {item!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
        if not 0 <= slot < world_size:
            raise FaultScheduleError(f"--faults item {item!r}: slot {slot} is not in [0, {world_size}) "
                                     f"(--world-size {world_size})")
        if not 1 <= step < steps:
            raise FaultScheduleError(f"--faults item {item!r}: step {step} is not in [1, {steps}) (--steps {steps}); "
                                     "a fault must happen while the job runs")
        duration: Optional[float] = None
        if kind == "kill":
            if secs is not None:
                raise FaultScheduleError(f"--faults item {item!r}: a kill takes no duration (write kill:{slot}@{step})")
        else:
            try:
                duration = float(secs) if secs is not None else DEFAULT_FREEZE_S
            except ValueError:
                raise FaultScheduleError(f"--faults item {item!r}: {secs!r} is not a number of seconds") from None
            if not 0 < duration <= 60:
                raise FaultScheduleError(f"--faults item {item!r}: freeze duration must be in (0, 60] seconds")
        out.append(Fault(kind, slot, step, duration))
    seen: dict[tuple[int, int], Fault] = {}
    for f in out:
        if (f.slot, f.at_step) in seen:
            raise FaultScheduleError(f"--faults: {seen[(f.slot, f.at_step)]} and {f} hit slot {f.slot} at the same "
                                     "step; give them different steps")
        seen[(f.slot, f.at_step)] = f
    by_step: dict[int, int] = {}
    for f in out:
        by_step[f.at_step] = by_step.get(f.at_step, 0) + 1
        if by_step[f.at_step] >= world_size:
            raise FaultScheduleError(f"--faults: every slot is hit at step {f.at_step}; "
                                     "at least one worker must survive each fault")
    return sorted(out, key=lambda f: (f.at_step, f.slot))


def parse_mesh(text: str) -> tuple[int, int]:
    """``--mesh``: ``"2x2"`` -> ``(2, 2)``, replicas x ranks per replica (here, beside the other
    demo option parser, because the CLI checks it before importing torch)."""
    r, sep, sh = text.lower().partition("x")
    if not sep or not r.isdigit() or not sh.isdigit() or int(r) < 1 or int(sh) < 1:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: give REPLICASxSHARDS, e.g. 2x2")
    return int(r), int(sh)

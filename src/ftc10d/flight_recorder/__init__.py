"""Flight Recorder for any backend: a ring buffer of ops, torch-format dumps, a hang analyzer.

Attached to every ftc10d group by default (``FTC10D_FLIGHT_RECORDER=0`` or
``ProcessGroup(..., flight_recorder=False)`` to opt out). ``dump()`` writes this
process's buffer where torch's ``fr_trace`` can read it; ``ftc10d trace DIR``
analyses a set of dumps across reconfigurations.
"""

from ftc10d.flight_recorder.dump import dump, dump_prefix, snapshot
from ftc10d.flight_recorder.hooks import attach
from ftc10d.flight_recorder.recorder import Entry, FlightRecorder, get_recorder

__all__ = ["dump", "dump_prefix", "snapshot", "attach", "get_recorder", "FlightRecorder", "Entry"]

"""Test-wide settings and fixtures: flight-recorder dumps go to a temporary folder, never
to ~/.cache; ``coordinator`` is a real membership coordinator (TCPStore) in the test process."""

import os
import tempfile
from typing import Iterator

import pytest

from ftc10d.membership import Coordinator

os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.mkdtemp(prefix="ftc10d-fr-"), "rank_"))


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    """A coordinator in the test process; members watch each other (its detector is off)."""
    co = Coordinator(detect=False).start()
    try:
        yield co
    finally:
        co.close()

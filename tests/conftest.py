"""Test-wide settings: flight-recorder dumps go to a temporary folder, never to ~/.cache."""

import os
import tempfile

os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.mkdtemp(prefix="ftc10d-fr-"), "rank_"))

"""The demo's job: ftc10d vs plain torch DDP (per-step cost) and vs a torchrun restart (recovery).

Same as ``ftc10d bench recovery``; see ``src/ftc10d/demo/bench.py`` and docs/benchmarks.md.

    python benchmarks/recovery.py [--json] [--steps 300] [--rounds 2] [--out bench-out]
"""

from __future__ import annotations

import sys
from typing import Optional

from ftc10d.cli import main as cli_main


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(["bench", "recovery", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

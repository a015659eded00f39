"""``python -m ftc10d.integrations.torchtitan --script``: the path of the script to give
``ftc10d launch`` (it runs scripts by path); ``--assets DIR``: build the tokenizer and
dataset of :mod:`.assets` in DIR."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m ftc10d.integrations.torchtitan", description=__doc__)
    p.add_argument("--script", action="store_true", help="print the training script's path")
    p.add_argument("--assets", metavar="DIR", help="write a tokenizer and a dataset for the debug model to DIR")
    args = p.parse_args()
    if args.script:
        print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"))
    if args.assets:
        from ftc10d.integrations.torchtitan.assets import build

        tok, data = build(args.assets)
        print(f"--hf-assets-path {tok} --dataloader.dataset-path {data}")
    if not (args.script or args.assets):
        p.print_help(sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A launcher test worker that joins the membership (init_from_env) and then idles until killed."""

import sys
import time

from ftc10d.train import init_from_env


def main() -> int:
    pg, member = init_from_env()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())

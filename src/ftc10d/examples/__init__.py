"""Small, runnable examples of ftc10d; ``ftc10d demo`` runs them.

They live in the package (not in a top-level ``examples/`` folder) so that the
worker functions are importable by the processes that ``spawn``/``forkserver``
start, wherever ftc10d is installed.
"""

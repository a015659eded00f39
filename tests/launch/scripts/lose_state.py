"""Under ``ftc10d launch``: join the job, then raise an uncaught error of the kind given in
argv[1] (``StateLostError``, ``ReplicaDivergenceError`` or ``RuntimeError``) on rank 1; rank 0
is done at once. The launcher's exit code says what ``init_from_env``'s hook made of it."""

import os
import sys

import ftc10d
from ftc10d.train import init_from_env

pg, member = init_from_env()
if int(os.environ["RANK"]) == 1:
    kind = sys.argv[1]
    raise RuntimeError("test: an ordinary error") if kind == "RuntimeError" else getattr(ftc10d, kind)(
        f"test: {kind} on purpose")

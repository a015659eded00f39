"""Collective signature check: mismatched collectives become a typed error, not a SIGABRT.

Why it exists: when ranks call the same collective with different shapes or dtypes,
Gloo's TCP pair receives more (or fewer) bytes than it expects and throws on its I/O
thread, which ends the receiving process with ``std::terminate`` (SIGABRT); a different
op or reduce op on each rank silently computes garbage or hangs. Before any data
moves, each rank hashes what it is about to do (op, root, reduce op, shapes, dtypes)
and the members all-reduce ``[h, -h]`` with MAX: the two maxima cancel iff every
rank's hash is the same. That is one 16-byte all-reduce on the same communicator, so
it can never itself mismatch; only when it fails do the ranks all-gather their
signatures (fixed-size buffers) to say who called what.

It costs one small round trip per collective (the op waits for the slowest rank
before sending), which is why it is opt-in, like torch's own check
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose ``ProcessGroupWrapper`` does the same with
a side group). Point-to-point ops are not checked: a pair cannot agree without a
round trip that would serialise every send.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from ftc10d.types import CollectiveMismatchError, InvalidOptionError

#: ftc10d's own switch; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns the check on too.
CHECK_ENV = "FTC10D_CHECK_COLLECTIVES"
#: Bytes of each rank's signature in the all-gather that explains a mismatch.
_SIG_BYTES = 512
_MASK = (1 << 62) - 1

#: Ops whose tensors legitimately differ in shape across ranks: only dtypes (and the
#: trailing dimensions of a single-tensor all-to-all) are compared.
_DTYPE_ONLY = frozenset({"all_to_all"})
_ROWS_MAY_DIFFER = frozenset({"all_to_all_single"})
#: Ops whose inputs exist on the root only: the outputs are what every rank shares.
_FROM_OUTPUTS = frozenset({"scatter"})
#: Ops whose root-only tensors are the outputs: the inputs are what every rank shares.
_ROOTED = frozenset({"broadcast", "reduce", "gather", "gather_into_tensor", "scatter"})


_MAX = _c10d.AllreduceOptions()
_MAX.reduceOp = dist.ReduceOp.MAX


def enabled_from_env(environ: Optional[dict[str, str]] = None) -> bool:
    """Whether the check is on by default: ``FTC10D_CHECK_COLLECTIVES=1`` or torch's
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; ``FTC10D_CHECK_COLLECTIVES=0`` wins over both."""
    env = os.environ if environ is None else environ
    flag = env.get(CHECK_ENV, "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    if flag:
        raise InvalidOptionError(f"{CHECK_ENV}={flag!r}: use 1 (check every collective) or 0 (do not)")
    return env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"


def _describe(tensors: Sequence[torch.Tensor], shapes: str) -> str:
    parts = []
    for t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if shapes == "none":
            parts.append(dtype)
        elif shapes == "rows":
            parts.append(f"{dtype}[*,{','.join(map(str, t.shape[1:]))}]")
        else:
            parts.append(f"{dtype}[{','.join(map(str, t.shape))}]")
    return " ".join(parts)


def signature(op: str, root: int, opts: Any, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> str:
    """What every rank must agree on for ``op`` to be safe: readable, since it is what a
    mismatch error shows."""
    tensors = outputs if op in _FROM_OUTPUTS else inputs
    shapes = "none" if op in _DTYPE_ONLY else "rows" if op in _ROWS_MAY_DIFFER else "full"
    sig = f"{op}({_describe(tensors, shapes)})"
    if op in _ROOTED:
        sig += f" root={root}"
    reduce_op = getattr(opts, "reduceOp", None)
    if reduce_op is not None:
        sig += f" op={str(getattr(reduce_op, 'op', reduce_op)).rsplit('.', 1)[-1]}"
    return sig


def _digest(sig: str) -> int:
    return int.from_bytes(hashlib.blake2b(sig.encode(), digest_size=8).digest(), "little") & _MASK


def check(backend: Any, sig: str, *, op: str, seq: int, uuid: Optional[int], rank: int, size: int) -> None:
    """Agree on ``sig`` with every member, or raise :class:`CollectiveMismatchError` on all of them.

    Backend failures (a peer gone, a timeout) propagate as the backend raised them:
    the caller types them like a failure of the op itself."""
    if size == 1:
        return
    h = _digest(sig)
    probe = torch.tensor([h, -h], dtype=torch.int64)
    backend.allreduce([probe], _MAX).wait()
    if int(probe[0]) + int(probe[1]) == 0:
        return
    mine = torch.zeros(_SIG_BYTES, dtype=torch.uint8)
    raw = sig.encode()[:_SIG_BYTES]
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    everyone = [torch.zeros(_SIG_BYTES, dtype=torch.uint8) for _ in range(size)]
    backend.allgather([everyone], [mine]).wait()
    sigs = {r: bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for r, t in enumerate(everyone)}
    lines = "; ".join(f"rank {r}: {s}" for r, s in sigs.items())
    raise CollectiveMismatchError(
        f"{op} #{seq}: ranks called different collectives ({lines}). Nothing was sent and the group is "
        f"unchanged (rank {rank} of {size}); make every rank issue the same op with the same shapes, dtypes, "
        "root and reduce op, in the same order.",
        op=op, seq=seq, uuid=uuid, signatures=sigs,
    )

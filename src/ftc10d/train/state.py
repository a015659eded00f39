"""State as bytes without pickle: a JSON skeleton plus one flat tensor buffer.

Why not ``torch.save``: it pickles, and a joiner would unpickle bytes that came
over the network (invariant 5 forbids it). A state dict is a tree of dicts,
lists, tuples, tensors and scalars; the skeleton (structure, scalars, dtypes,
shapes, offsets) goes out as JSON, and every tensor's bytes go out packed into
one ``uint8`` buffer, so the transfer is one large message that runs at the
transport's full rate. Each tensor starts at an aligned offset, so the receiver
reads it as a view of that buffer without another copy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ftc10d.types import FTC10DError

#: Offsets of tensors in the packed buffer are multiples of this (any dtype can view them).
ALIGN = 64
FORMAT = "ftc10d-state-1"

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}


class StateFormatError(FTC10DError, ValueError):
    """A state dict holds something that cannot be sent without pickle, or a received
    skeleton does not describe the buffer that came with it."""


@dataclass
class Packed:
    """A state dict ready to send: ``skeleton`` (JSON text) and ``buffer`` (uint8)."""

    skeleton: str
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel()) + len(self.skeleton)


def _encode(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise StateFormatError(f"{path}: only dense (strided) tensors can be sent, got layout {obj.layout}")
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise StateFormatError(f"{path}: dtype {obj.dtype} is not supported for state transfer")
        tensors.append(obj)
        return {"T": len(tensors) - 1, "dtype": name, "shape": list(obj.shape)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise StateFormatError(f"{path}: dict key {k!r} of type {type(k).__name__} cannot be sent")
            items.append([k, _encode(v, tensors, f"{path}.{k}")])
        return {"D": items}
    if isinstance(obj, list):
        return {"L": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"U": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise StateFormatError(
        f"{path}: a {type(obj).__name__} cannot be sent to a joiner (only tensors, dicts, lists, tuples, "
        "numbers, strings and None: nothing is pickled); convert it in your state_dict()"
    )


@dataclass
class Layout:
    """Where each tensor of a state goes in the flat buffer (computed without copying)."""

    skeleton: str
    tensors: list[torch.Tensor]
    offsets: list[int]
    total: int


def layout(state: Any) -> Layout:
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors, "state")
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    doc: dict[str, Any] = {"format": FORMAT, "tree": tree, "offsets": offsets, "nbytes": total}
    devices = {str(i): t.device.type for i, t in enumerate(tensors) if t.device.type != "cpu"}
    if devices:  # where a tensor lives at the source: a receiver puts it on the same device type
        doc["dev"] = devices
    skeleton = json.dumps(doc, separators=(",", ":"))
    return Layout(skeleton, tensors, offsets, total)


def pack(state: Any) -> Packed:
    """Flatten ``state`` into a skeleton and one aligned byte buffer (one copy of each tensor)."""
    lay = layout(state)
    buffer = torch.empty(lay.total, dtype=torch.uint8)
    for i, (t, off) in enumerate(zip(lay.tensors, lay.offsets)):
        n = t.numel() * t.element_size()
        if n:
            buffer[off:off + n].copy_(as_bytes(t))
        end = lay.offsets[i + 1] if i + 1 < len(lay.offsets) else lay.total
        buffer[off + n:end].zero_()  # padding: deterministic bytes, so equal states hash equal
    return Packed(lay.skeleton, buffer)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


#: Tensors at least this big travel as messages of their own, straight from their memory;
#: smaller neighbours are copied together into one message.
DIRECT_BYTES = 256 * 1024


def segments(sizes: list[int], offsets: list[int]) -> list[tuple[int, int, list[int]]]:
    """Split the buffer into messages: ``(start, end, tensor indices)``. Both ends compute
    the same split from the skeleton alone (tensor byte sizes and offsets)."""
    out: list[tuple[int, int, list[int]]] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append((offsets[run[0]], offsets[run[-1]] + sizes[run[-1]], list(run)))
            run.clear()

    for i, n in enumerate(sizes):
        if n >= DIRECT_BYTES:
            flush()
            out.append((offsets[i], offsets[i] + n, [i]))
        elif n:
            run.append(i)
    flush()
    return out


#: What a malformed skeleton (valid JSON, wrong shape) raises while it is walked; all of
#: it becomes StateFormatError (RecursionError, a RuntimeError, for absurd nesting).
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError)


def skeleton_sizes(skeleton: str) -> tuple[list[int], list[int], int]:
    """Byte size and offset of every tensor described by a (validated) skeleton, and the total."""
    try:
        return _skeleton_sizes(skeleton)
    except StateFormatError:
        raise
    except _MALFORMED as exc:
        raise StateFormatError(f"malformed state skeleton: {type(exc).__name__}: {exc}") from None


def _skeleton_sizes(skeleton: str) -> tuple[list[int], list[int], int]:
    doc = _load_skeleton(skeleton)
    specs: dict[int, tuple[str, list[int]]] = {}
    _tensor_specs(doc["tree"], specs)
    sizes = [n for _, _, n in _tensor_table(specs, len(doc["offsets"]))]
    return sizes, [int(o) for o in doc["offsets"]], int(doc["nbytes"])


def _tensor_table(specs: dict[int, tuple[str, list[int]]], count: int) -> list[tuple[torch.dtype, list[int], int]]:
    """(dtype, shape, byte size) of tensors 0..count-1 of a skeleton, validated."""
    out = []
    for i in range(count):
        if i not in specs:
            raise StateFormatError(f"state skeleton lists offset {i} without a tensor")
        name, shape = specs[i]
        dtype = _DTYPES.get(name)
        if dtype is None:
            raise StateFormatError(f"state tensor {i} has unknown dtype {name!r}")
        elems = 1
        for d in shape:
            if d < 0:
                raise StateFormatError(f"state tensor {i} has a negative dimension {d}")
            elems *= d
        out.append((dtype, shape, elems * torch.empty((), dtype=dtype).element_size()))
    return out


def _load_skeleton(skeleton: str) -> dict[str, Any]:
    try:
        doc = json.loads(skeleton)
    except ValueError as exc:
        raise StateFormatError(f"state skeleton is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateFormatError(f"state skeleton has format {doc.get('format') if isinstance(doc, dict) else None!r},"
                               f" expected {FORMAT!r} (a peer running another ftc10d version?)")
    return doc


def _decode(node: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "T" in node:
            return views[node["T"]]
        if "D" in node:
            return {k: _decode(v, views) for k, v in node["D"]}
        if "L" in node:
            return [_decode(v, views) for v in node["L"]]
        if "U" in node:
            return tuple(_decode(v, views) for v in node["U"])
        raise StateFormatError(f"unknown node {sorted(node)} in a state skeleton")
    return node


def _tensor_specs(node: Any, out: dict[int, tuple[str, list[int]]]) -> None:
    if isinstance(node, dict):
        if "T" in node:
            out[int(node["T"])] = (node["dtype"], [int(s) for s in node["shape"]])
            return
        for key in ("D", "L", "U"):
            if key in node:
                for v in node[key]:
                    _tensor_specs(v[1] if key == "D" else v, out)


def _paths(node: Any, path: str, out: dict[int, str]) -> None:
    if isinstance(node, dict):
        if "T" in node:
            out[int(node["T"])] = path
        elif "D" in node:
            for k, v in node["D"]:
                _paths(v, f"{path}.{k!r}", out)
        else:
            for key in ("L", "U"):
                for i, v in enumerate(node.get(key, ())):
                    _paths(v, f"{path}[{i}]", out)


def in_place_targets(skeleton: str, local: Any) -> dict[int, torch.Tensor]:
    """Tensors of ``local`` (this rank's own state) that can receive the incoming tensor of the
    same path, dtype and shape directly: index in ``skeleton`` -> local tensor.

    Why: the joiner's model already has its parameters; receiving into them skips a fresh
    buffer (page faults on every byte) and the copy of ``load_state_dict`` (which then copies
    each tensor onto itself: a no-op)."""
    doc = _load_skeleton(skeleton)
    incoming: dict[int, str] = {}
    specs: dict[int, tuple[str, list[int]]] = {}
    try:
        _paths(doc["tree"], "state", incoming)
        _tensor_specs(doc["tree"], specs)
    except _MALFORMED as exc:
        raise StateFormatError(f"malformed state skeleton: {type(exc).__name__}: {exc}") from None
    lay = layout(local)
    mine: dict[int, str] = {}
    _paths(json.loads(lay.skeleton)["tree"], "state", mine)
    by_path = {p: lay.tensors[i] for i, p in mine.items()}
    out: dict[int, torch.Tensor] = {}
    for i, path in incoming.items():
        t = by_path.get(path)
        if t is not None and t.is_contiguous() and i in specs:
            name, shape = specs[i]
            if str(t.dtype).removeprefix("torch.") == name and list(t.shape) == shape:
                out[i] = t
    return out


def unpack(skeleton: str, buffer: torch.Tensor, received: Optional[dict[int, torch.Tensor]] = None) -> Any:
    """The state dict described by ``skeleton``; its tensors are views of ``buffer``, except
    those in ``received`` (index -> a tensor the bytes were received into directly).
    A skeleton that does not describe ``buffer`` raises StateFormatError, nothing else."""
    try:
        return _unpack(skeleton, buffer, received)
    except StateFormatError:
        raise
    except _MALFORMED as exc:
        raise StateFormatError(f"malformed state skeleton: {type(exc).__name__}: {exc}") from None


def device_targets(skeleton: str, indices: Any) -> dict[int, torch.Tensor]:
    """For each of ``indices`` (tensors that travel as a message of their own) that lives on a
    device at the source (a CUDA tensor), an empty tensor of its dtype and shape on that device
    type here: the receiver receives it there, so that both ends issue the message on the same
    channel of a two-channel group (device to device, :mod:`ftc10d.pg.channels`)."""
    doc = _load_skeleton(skeleton)
    devices = doc.get("dev") or {}
    if not devices:
        return {}
    specs: dict[int, tuple[str, list[int]]] = {}
    _tensor_specs(doc["tree"], specs)
    table = _tensor_table(specs, len(doc["offsets"]))
    return {i: torch.empty(table[i][1], dtype=table[i][0], device=devices[str(i)])
            for i in indices if str(i) in devices}


def _unpack(skeleton: str, buffer: torch.Tensor, received: Optional[dict[int, torch.Tensor]]) -> Any:
    doc = _load_skeleton(skeleton)
    if int(doc["nbytes"]) != buffer.numel():
        raise StateFormatError(f"state buffer has {buffer.numel()} bytes, the skeleton describes {doc['nbytes']}")
    specs: dict[int, tuple[str, list[int]]] = {}
    _tensor_specs(doc["tree"], specs)
    offsets = doc["offsets"]
    views: list[torch.Tensor] = []
    for i, (dtype, shape, n) in enumerate(_tensor_table(specs, len(offsets))):
        off = int(offsets[i])
        if off < 0 or off + n > buffer.numel():
            raise StateFormatError(f"state tensor {i} lies outside the buffer")
        if received is not None and i in received:
            views.append(received[i])
            continue
        views.append(buffer[off:off + n].view(dtype).reshape(shape))
    return _decode(doc["tree"], views)


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in ``state``, in a fixed (traversal) order."""
    out: list[torch.Tensor] = []
    _encode(state, out, "state")
    return out


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The odd weights of ``n`` words, on ``device`` (a CUDA state is fingerprinted where it is)."""
    w = _WEIGHTS.get((n, device))
    if w is None:
        w = _WEIGHTS[(n, device)] = torch.arange(1, 2 * n, 2, dtype=torch.int64, device=device).to(torch.int32)
    return w


def fingerprint(state: Any) -> str:
    """A cheap value that differs when any bit of any tensor differs (almost surely).

    Each tensor's bytes, read as int32 words, are multiplied by position-dependent
    odd weights in int32 arithmetic (wrapping: a flipped bit changes its product by
    2^k times an odd number, never by 0 mod 2^32) and summed in int64; the last 1-3
    bytes are added with their own weights. Half the cost of doing it in int64 (no
    widened copy); a sha256 per step would cost more than the step of a small model.
    """
    acc = []
    for t in tensors_of(state):
        raw = t.detach().reshape(-1).view(torch.uint8)
        n = raw.numel()
        if n == 0:
            acc.append(0)
            continue
        head = raw[: n - n % 4].view(torch.int32)
        value = int((head * _weights(head.numel(), head.device)).sum(dtype=torch.int64)) if head.numel() else 0
        if n % 4:
            tail = raw[n - n % 4:].to("cpu", torch.int64)
            value = value * 1_000_003 + int((tail * torch.arange(1, 2 * tail.numel(), 2)).sum())
        acc.append(value & 0xFFFFFFFFFFFF)
    return hashlib.blake2b(repr(acc).encode(), digest_size=8).hexdigest()


def state_hash(state: Any) -> str:
    """sha256 over every tensor's bytes and the skeleton: the end-of-run equality check."""
    h = hashlib.sha256()
    packed = pack(state)
    h.update(packed.skeleton.encode())
    h.update(packed.buffer.numpy().tobytes())
    return h.hexdigest()

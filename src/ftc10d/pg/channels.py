"""Two channels in one group: ``ProcessGroup(..., backend="cpu:gloo,cuda:nccl")``.

On a GPU cluster the data (gradients, FSDP2's all-gathers and reduce-scatters, the state
handover) runs on NCCL, while the step-commit protocol's small messages, and everything that
must work while a device communicator is being torn down, need a CPU channel. torch writes
this ``init_process_group("cpu:gloo,cuda:nccl")``: one group, one backend per device type,
each op dispatched by its tensors' device. An ftc10d group does the same, with the contract
held for the pair:

- **one configuration, both channels**: a generation connects one communicator per channel
  (store prefixes ``cfg/<uuid>/<spec>/<device>``) in the same rendezvous, under one uuid;
- **one abort**: the generation's abort cuts every channel (after the abort hooks, before
  the drain), whichever channel's op failed first; a failure on either channel types and
  names the dead peer as on one channel;
- **dispatch by device, as torch**: an op whose tensors are on a device the *data channel*
  (the last one of the spec) carries runs there; any other op runs on the channel of its
  tensors' device type; an op without tensors (``barrier``) runs on the CPU channel.
  NCCL carries only CUDA tensors, so CPU tensors go to Gloo, CUDA tensors to NCCL.
- **the control channel**: code that must stay off the device channel (the Manager's vote,
  identity and fingerprint exchanges, recovery plans) issues its ops inside
  :func:`control`: they run on the CPU channel whatever channel would carry them otherwise.

Proven on CPU with ``backend="cpu:gloo,cuda:gloo-as-nccl"`` (:class:`GlooAsNccl`: real Gloo
sockets, declaring NCCL's abort and wait semantics and carrying CPU tensors), where the data
path really runs on the second communicator and the control path on the first
(``tests/pg/test_channels.py``, ``ftc10d chaos --channels``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from datetime import timedelta
from typing import Any, ClassVar, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ftc10d.pg.backend import Communicator, FailureKind
from ftc10d.types import InvalidOptionError

#: The channel the control path (and ops without tensors) runs on.
CONTROL_DEVICE = "cpu"
#: torch's default for a machine with CUDA; ``init_process_group("ftc10d")`` picks it there.
CPU_AND_CUDA = "cpu:gloo,cuda:nccl"

class _Scope(threading.local):
    control = False  # a class default: reading it never takes getattr's missing-attribute path


_scope = _Scope()
#: Ops issued on two-channel groups in this process, by channel ("control", "data"): what the
#: tests check to see that each path really took its channel.
ISSUED: collections.Counter = collections.Counter()


@contextlib.contextmanager
def control() -> Iterator[None]:
    """Ops issued by this thread inside the block run on the CPU channel of a two-channel
    group (on a one-channel group: nothing changes)."""
    before = _scope.control
    _scope.control = True
    try:
        yield
    finally:
        _scope.control = before


def in_control() -> bool:
    return _scope.control


def parse(spec: str) -> Optional[tuple[tuple[str, str], ...]]:
    """``"cpu:gloo,cuda:nccl"`` -> ``(("cpu", "gloo"), ("cuda", "nccl"))``; None for a plain
    adapter name. Raises :class:`InvalidOptionError` for a malformed spec."""
    if ":" not in spec and "," not in spec:
        return None
    pairs = []
    for item in spec.split(","):
        device, _, name = item.strip().partition(":")
        if not device or not name:
            raise InvalidOptionError(f"backend {spec!r}: {item!r} is not DEVICE:BACKEND (e.g. 'cpu:gloo,cuda:nccl')")
        pairs.append((device.strip(), name.strip()))
    devices = [d for d, _ in pairs]
    if len(set(devices)) != len(devices):
        raise InvalidOptionError(f"backend {spec!r}: a device type is named twice")
    if CONTROL_DEVICE not in devices:
        raise InvalidOptionError(f"backend {spec!r}: an ftc10d group with several channels needs a 'cpu:...' "
                                 "channel (its control path runs there), e.g. 'cpu:gloo,cuda:nccl'")
    return tuple(pairs)


def _first_device(tensors: Sequence[Any]) -> Optional[str]:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            # is_cpu / is_cuda first: ~70 ns, where building t.device takes ~300 ns (per op)
            return "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type
    return None


class Channels(Communicator):
    """One communicator per device type, connected, cut and retired together (module docstring).

    Subclassed per spec by :func:`channels_adapter` (``specs``, ``name``)."""

    device = CONTROL_DEVICE
    specs: ClassVar[tuple[tuple[str, type[Communicator]], ...]] = ()
    #: Capabilities of the pair, for code that asks the generation's communicator (per-op ones
    #: are the channel's: ``ProcessGroup`` hands the chosen channel to each ``Work``).
    cut_fails_ops = True

    @classmethod
    def unavailable(cls) -> str:
        for device, sub in cls.specs:
            why = sub.unavailable()
            if why:
                return f"{cls.name!r}, channel {device!r}: {why}"
        return ""

    @classmethod
    def connect_abandoned(cls, thread: Any) -> None:
        for _, sub in cls.specs:  # the thread may be in any channel's connect
            sub.connect_abandoned(thread)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, timeout: timedelta) -> "Channels":
        connected: dict[str, Communicator] = {}
        try:
            for device, sub in cls.specs:
                connected[device] = sub.connect(dist.PrefixStore(device, store), rank, size, timeout)
        except BaseException:
            for comm in connected.values():  # those already connected: cut and dropped
                comm.cut()
            raise
        return cls(connected, rank, size)

    def __init__(self, channels: dict[str, Communicator], rank: int, size: int) -> None:
        self.channels = channels
        self.rank, self.size = rank, size
        self.control = channels[CONTROL_DEVICE]
        #: The data channel: the last one of the spec (``cuda:nccl`` in ``cpu:gloo,cuda:nccl``).
        self.data = channels[self.specs[-1][0]]
        #: torch helpers asking for capabilities, the collective check, ``monitored_barrier``:
        #: the CPU channel's backend.
        self.backend = self.control.backend

    def channel_for(self, tensors: Sequence[Any]) -> Communicator:
        device = _first_device(tensors)
        if device is None:
            ISSUED["control"] += 1
            return self.control
        if not _scope.control and device in self.data.carries:
            ISSUED["data"] += 1
            return self.data
        ISSUED["control" if device == CONTROL_DEVICE else "data"] += 1
        comm = self.channels.get(device)
        if comm is None or device not in comm.carries:
            raise InvalidOptionError(f"no channel of this group ({self.name!r}) carries {device} tensors: "
                                     f"move them to {' or '.join(sorted(self.channels))}")
        return comm

    def channel_for_device(self, device: Any) -> Communicator:
        if device is None:
            return self.control
        kind = torch.device(device).type
        return self.data if kind in self.data.carries else self.channels.get(kind, self.control)

    def cut(self) -> int:
        return sum(comm.cut() for comm in self.channels.values())  # each never raises

    def classify(self, exc: BaseException) -> FailureKind:
        kinds = [comm.classify(exc) for comm in self.channels.values()]
        for kind in (FailureKind.PEER_CLOSED, FailureKind.TIMEOUT, FailureKind.REJECTED_ARGS):
            if kind in kinds:
                return kind
        return FailureKind.OTHER

    def peer_of(self, text: str) -> Optional[int]:
        for comm in self.channels.values():
            peer = comm.peer_of(text)
            if peer is not None:
                return peer
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        for comm in self.channels.values():
            comm.set_timeout(timeout)

    def retire(self) -> Any:
        backends = [comm.retire() for comm in self.channels.values()]
        self.backend = None
        return [b for b in backends if b is not None] or None


_ADAPTERS: dict[str, type[Channels]] = {}


def channels_adapter(spec: str, pairs: tuple[tuple[str, str], ...]) -> type[Channels]:
    """The adapter class for a spec (one class per spec, made once)."""
    cls = _ADAPTERS.get(spec)
    if cls is None:
        from ftc10d.pg.backend import adapter

        subs = tuple((device, adapter(name)) for device, name in pairs)
        for device, sub in subs:
            if device not in sub.carries:
                raise InvalidOptionError(f"backend {spec!r}: {sub.name!r} does not carry {device} tensors "
                                         f"(it carries {sorted(sub.carries)})")
        cls = type(f"Channels[{spec}]", (Channels,), {"name": spec, "specs": subs})
        _ADAPTERS[spec] = cls
    return cls


def default_backend() -> str:
    """What ``init_process_group("ftc10d")`` picks, as torch does: ``cpu:gloo,cuda:nccl`` where
    CUDA and NCCL can run, else ``gloo``; ``FTC10D_BACKEND`` overrides."""
    import os

    chosen = os.environ.get("FTC10D_BACKEND", "").strip()
    if chosen:
        return chosen
    from ftc10d.pg.nccl import unavailable_reason

    return CPU_AND_CUDA if not unavailable_reason() else "gloo"


def control_backend(spec: str) -> str:
    """The adapter of ``spec``'s CPU channel (``spec`` itself for a one-adapter group): for a
    group that carries only control messages."""
    pairs = parse(spec)
    return spec if pairs is None else dict(pairs)[CONTROL_DEVICE]


def mesh_device(spec: str) -> str:
    """The device type of a ``DeviceMesh`` over a group of ``spec``: its data channel's device
    where this process has it (``cuda`` for ``cpu:gloo,cuda:nccl`` with CUDA), else ``cpu``."""
    pairs = parse(spec)
    device = pairs[-1][0] if pairs is not None else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device if device in ("cpu", "cuda") else "cpu"

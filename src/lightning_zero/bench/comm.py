"""Counting collectives the same way for every variant, at the dispatcher.

[Note: what is counted]
Every `torch.distributed` collective, whoever issues it — our engine, DDP's C++ reducer, FSDP2,
`ZeroRedundancyOptimizer`, DeepSpeed — ends up as a `c10d::*` operator (`c10d::allreduce_`,
`c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, `c10d::broadcast_`, ...) called through
torch's dispatcher, even from C++ (`ProcessGroup::allreduce` dispatches to `c10d::allreduce_`).
A `TorchDispatchMode` sees each such call, on every thread autograd runs on, so one counter serves
all variants; wrapping the Python functions would miss DDP's reducer and any module that bound a
collective to a local name at import.

Per call we record the kind, the bytes of the full (unsharded) buffer — the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce or broadcast — and the bytes
this rank receives in a ring algorithm ("wire bytes"): (N-1)/N of the buffer for all-gather,
reduce-scatter, broadcast, reduce and all-to-all (averaged over ranks for the rooted ones),
2·(N-1)/N for all-reduce (a reduce-scatter then an all-gather), the buffer itself for send/recv,
nothing for barriers. This is the convention of the ZeRO paper's 2Ψ / 3Ψ (see `theory.py`). N is
the world size: every process group in this benchmark spans all ranks.

A dispatch mode sees every operator, not only collectives, and costs Python time on each; so it is
switched on for one dedicated step after the timed ones (`rank.py`), never while timing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class _Collective:
    """How one `c10d` operator is counted."""

    kind: str
    """The name it is reported under."""
    buffer_arg: Optional[int]
    """Position of the argument holding the full buffer (None: no data, e.g. a barrier)."""
    ring_factor: int
    """Buffers' worth moved per rank in a ring, in units of (N-1)/N; 0 means "the buffer itself"
    (point-to-point)."""


_COLLECTIVES: dict[str, _Collective] = {
    "allreduce_": _Collective("all_reduce", 0, 2),
    "allreduce_coalesced_": _Collective("all_reduce", 0, 2),
    "_allgather_base_": _Collective("all_gather", 0, 1),
    "allgather_": _Collective("all_gather", 0, 1),
    "allgather_coalesced_": _Collective("all_gather", 0, 1),
    "allgather_into_tensor_coalesced_": _Collective("all_gather", 0, 1),
    "_reduce_scatter_base_": _Collective("reduce_scatter", 1, 1),
    "reduce_scatter_": _Collective("reduce_scatter", 1, 1),
    "reduce_scatter_tensor_coalesced_": _Collective("reduce_scatter", 1, 1),
    "broadcast_": _Collective("broadcast", 0, 1),
    "reduce_": _Collective("reduce", 0, 1),
    "alltoall_base_": _Collective("all_to_all", 1, 1),
    "alltoall_": _Collective("all_to_all", 1, 1),
    "gather_": _Collective("gather", 0, 1),
    "scatter_": _Collective("scatter", 1, 1),
    "send": _Collective("send", 0, 0),
    "recv_": _Collective("recv", 0, 0),
    "recv_any_source_": _Collective("recv", 0, 0),
    "barrier": _Collective("barrier", None, 1),
    "monitored_barrier_": _Collective("barrier", None, 1),
}


def _nbytes(obj: Any) -> int:
    """Bytes of a tensor, or of every tensor in (nested) lists of them."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(item) for item in obj)
    return 0


@dataclass(frozen=True)
class CommCount:
    """Collectives one rank issued in one step, by kind; see [Note: what is counted]."""

    calls: dict[str, int]
    """Collectives issued, by kind ("all_gather", "reduce_scatter", ...; "other:NAME" for an unknown operator)."""
    buffer_bytes: dict[str, int]
    """Full-buffer bytes, summed per kind."""
    wire_bytes: dict[str, float]
    """Bytes received per rank in a ring algorithm, summed per kind."""
    total_calls: int
    """Sum of `calls`."""
    total_buffer_bytes: int
    """Sum of `buffer_bytes`."""
    total_wire_bytes: float
    """Sum of `wire_bytes`: what is compared with the floor."""


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter(world_size) as counter:` counts the `c10d` operators called inside.

    `recording = False` keeps the mode installed but ignores calls (for measuring memory mid-step)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.share = Fraction(world_size - 1, world_size)
        self.recording = True
        self._calls: Counter[str] = Counter()
        self._buffer: Counter[str] = Counter()
        self._wire: Counter[str] = Counter()
        self.unknown: Counter[str] = Counter()
        """`c10d` operators not in the table above (reported, never silently dropped)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if self.recording and func.namespace == "c10d":
            self._record(func._opname, args)
        return func(*args, **(kwargs or {}))

    def _record(self, opname: str, args: tuple) -> None:
        spec = _COLLECTIVES.get(opname)
        if spec is None:
            self.unknown[opname] += 1
            return
        buffer = 0 if spec.buffer_arg is None else _nbytes(args[spec.buffer_arg])
        self._calls[spec.kind] += 1
        self._buffer[spec.kind] += buffer
        self._wire[spec.kind] += buffer if spec.ring_factor == 0 else float(spec.ring_factor * self.share * buffer)

    def result(self) -> CommCount:
        calls = dict(self._calls)
        if self.unknown:
            calls.update({f"other:{name}": n for name, n in self.unknown.items()})
        return CommCount(
            calls=calls,
            buffer_bytes=dict(self._buffer),
            wire_bytes=dict(self._wire),
            total_calls=sum(calls.values()),
            total_buffer_bytes=sum(self._buffer.values()),
            total_wire_bytes=float(sum(self._wire.values())),
        )

"""The recorded run's device: streams, events and collectives as on a GPU with NCCL, recorded instead
of run asynchronously (see [Note: the schedule explorer]).

Installed through the stream layer (``streams.simulating``), it gives every engine built inside a
device with streams: ``ReduceStream``, ``CopyStream`` and the buffer pool's free lists work as on CUDA,
and collectives keep NCCL's contract (a wait orders the current stream; the host never blocks). The
CPU still computes every value where it is issued; what the device would do is written down:

- each aten op (a ``TorchDispatchMode`` on every thread of the engine) as a ``Kernel`` on the
  issuing thread's current stream, or a ``HostOp`` where only host memory is involved (tensors the
  engine keeps on the host, tagged by ``device_roles``) or the thread is the host step's worker
  outside a stream of its own (inside one, its write-backs are kernels like any other);
  with the byte ranges it reads and writes; blocking reads of device values (``.item()``,
  ``.tolist()``, ``torch.equal``, a synchronous copy between host and device) as a ``HostWait`` on
  the current stream first;
- each stream and event operation, host wait and ``record_stream`` from the stream layer;
- each collective, on its group's stream of this rank, after a wait of that stream for the issuing
  one (as ProcessGroupNCCL issues it), its result taken from the reference run (``collective_log``);
- the host threads' handoffs (``host_threads.py``).

Memory is named by allocation: a fresh output of an op, or a storage first seen at an address, is a
new buffer; views share their buffer. So a pool buffer lent again is the same buffer (its reuse is
checked), and a freed tensor's memory taken again by the CPU allocator is another one (the CUDA
caching allocator's reuse is the GPU tier's to check).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Optional, Union

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_zero.engine import device_roles
from lightning_zero.engine.comm import collectives, streams
from lightning_zero.engine.comm.streams import DeviceStreams

from schedules.collective_log import CollectiveLog, fill
from schedules.trace import (
    Await, Collective, CollectiveWait, Entry, HostOp, HostWait, Kernel, KeepAlive, Mark, Range, RecordEvent,
    Release, Signal, Trace, WaitEvent, WaitStream,
)  # fmt: skip


@dataclass(frozen=True)
class SimStream:
    id: int
    role: str


@dataclass(frozen=True)
class SimEvent:
    id: int


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_METADATA_OPS = {"empty", "empty_strided", "empty_like", "set_", "resize_", "resize_as_", "lift_fresh", "_has_same_storage_numel"}
"""Ops that allocate or describe a tensor without reading or writing its data."""
_HOST_SYNCS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2", "allclose"}
"""Ops whose result the host needs, so that on a GPU the host waits for the stream first."""


class SimulatedDevice(DeviceStreams):
    """One rank's simulated device, recording into ``trace`` and taking collective results from ``log``."""

    nccl_semantics = True
    pins_host_memory = False

    def __init__(self, rank: int, log: CollectiveLog) -> None:
        self.trace = Trace(rank)
        self._log = log
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams: list[SimStream] = []
        self.compute = self.new_stream("compute")
        self._events = itertools.count()
        self._keeps = itertools.count()
        self._thread_ids = itertools.count()
        self._buffers: dict[int, tuple[int, int, int]] = {}  # a storage's address -> its buffer, storage, bytes
        self._device_writer: dict[int, int] = {}  # buffer -> the stream of the kernel that wrote it last
        self._buffer_ids = itertools.count()
        self._groups: dict[int, tuple[int, SimStream, Any]] = {}  # id(group) -> (number, its stream, the group)
        self._group_seq: dict[int, int] = {}
        self._tokens: dict[Hashable, int] = {}  # a handoff's token -> its number
        self.recording = False
        self._main_modes: Optional[contextlib.ExitStack] = None

    # ---- being installed ------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator["SimulatedDevice"]:
        """Record everything the calling thread (and the engine's threads started inside) issues."""
        tracker = device_roles._TRACKER
        if tracker is None:
            raise RuntimeError("record inside device_roles.tracking_host_tensors(): the device tells host memory by its tags")
        tag = tracker.tag

        def tag_as_host(tensor: Tensor) -> None:
            tag(tensor)
            self._tagged_host(tensor)

        with streams.simulating(self), contextlib.ExitStack() as modes:
            self._join(modes, "main")
            tracker.tag = tag_as_host  # type: ignore[method-assign]
            self.recording = True
            try:
                yield self
            finally:
                self.recording = False
                del tracker.tag

    def streams_of(self, device: torch.device) -> "SimulatedDevice":
        return self

    def thread_started(self) -> None:
        self._join(contextlib.ExitStack(), threading.current_thread().name)  # kept until the thread ends

    def _join(self, modes: contextlib.ExitStack, name: str) -> None:
        number = next(self._thread_ids)
        self._local.thread = number
        self._local.current = self.compute
        self._local.muted = False
        self.trace.threads[number] = name
        modes.enter_context(_BlockingReads(self))
        modes.enter_context(_Kernels(self))

    @property
    def _thread(self) -> int:
        return getattr(self._local, "thread", -1)

    def _record(self, entry: Entry) -> None:
        if self.recording:
            with self._lock:
                self.trace.entries.append(entry)

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """What runs inside is the simulation's own work (a collective's result written), not the engine's."""
        self._local.muted, was = True, getattr(self._local, "muted", False)
        try:
            yield
        finally:
            self._local.muted = was

    # ---- the stream layer -----------------------------------------------------------------------
    def new_stream(self, role: str) -> SimStream:
        stream = SimStream(len(self._streams), role)
        self._streams.append(stream)
        self.trace.streams[stream.id] = role
        return stream

    def current_stream(self) -> SimStream:
        return getattr(self._local, "current", self.compute)

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[None]:
        previous, self._local.current = self.current_stream(), stream
        self._local.streamed = getattr(self._local, "streamed", 0) + 1
        try:
            yield
        finally:
            self._local.current = previous
            self._local.streamed -= 1

    def wait_stream(self, waiter: SimStream, waited: SimStream) -> None:
        self._record(WaitStream(self._thread, waiter.id, waited.id))

    def record_event(self, stream: SimStream, blocking: bool = False) -> SimEvent:
        event = SimEvent(next(self._events))
        self._record(RecordEvent(self._thread, stream.id, event.id))
        return event

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        self._record(WaitEvent(self._thread, stream.id, event.id))

    def host_waits(self, what: Union[SimEvent, SimStream]) -> None:
        if isinstance(what, SimEvent):
            self._record(HostWait(self._thread, "event.synchronize", event=what.id))
        else:
            self._record(HostWait(self._thread, f"{what.role}.synchronize", stream=what.id))

    def is_done(self, event: SimEvent) -> bool:
        return True  # asked for the memory report only; what is done is the replay's to say

    def keep_alive(self, tensor: Tensor, stream: SimStream) -> None:
        keep = next(self._keeps)
        self._record(KeepAlive(self._thread, stream.id, keep, tensor.numel() * tensor.element_size()))
        weakref.finalize(tensor, self._released, keep)

    def _released(self, keep: int) -> None:
        self._record(Release(self._thread, keep))

    def stream_key(self, stream: SimStream) -> Hashable:
        return "simulated", stream.id

    # ---- collectives ------------------------------------------------------------------------------
    def collective(self, kind: str, group: Any, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...], issue: Callable[[], Any]) -> Any:
        number, stream, seq = self._group_slot(group)
        issuing = self.current_stream()
        self._record(WaitStream(self._thread, stream.id, issuing.id))
        ranks = collectives.group_ranks(group)
        self._record(Collective(self._thread, stream.id, number, seq, kind, ranks, self._ranges(reads), self._ranges(writes)))
        result = self._log.take(CollectiveLog.key(kind, group))
        if not writes:  # an object collective: the host reads its result (NCCL: a device tensor, then a sync)
            self._record(CollectiveWait(self._thread, issuing.id, number, seq))
            self._record(HostWait(self._thread, kind, stream=issuing.id))
            return result
        with self.muted():
            fill(writes, result, f"{kind} number {seq} over ranks {list(ranks)} on rank {self.trace.rank}")
        return _SimWork(self, number, seq)

    def _group_slot(self, group: Any) -> tuple[int, SimStream, int]:
        group = collectives.resolved(group)
        slot = self._groups.get(id(group))
        if slot is None:
            number = len(self._groups)
            slot = self._groups[id(group)] = (number, self.new_stream(f"group {number}"), group)
        number, stream, _ = slot
        seq = self._group_seq.get(number, 0)
        self._group_seq[number] = seq + 1
        return number, stream, seq

    def collective_waited(self, number: int, seq: int) -> None:
        self._record(CollectiveWait(self._thread, self.current_stream().id, number, seq))

    def mark(self, name: str) -> None:
        """A phase of the scenario begins (replays measure per phase)."""
        self._record(Mark(self._thread, name))

    # ---- host-thread handoffs -----------------------------------------------------------------------
    def handoff(self, signal: bool, token: Hashable, name: str) -> None:
        """A host thread set (``signal``) or went on after ``token`` (``host_threads.py``)."""
        number = self._tokens.setdefault(token, len(self._tokens))
        self._record((Signal if signal else Await)(self._thread, number, name))

    # ---- kernels ----------------------------------------------------------------------------------
    def kernel(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Record one aten op the engine ran (see the module's docstring)."""
        name = func.overloadpacket.__name__
        if name in _METADATA_OPS:
            for t in _tensors(out):
                self._fresh(t)
            return
        inputs = _tensors((args, kwargs))
        written = _written(func, args, kwargs)
        input_storages = {_address(t) for t in inputs}
        fresh = [t for t in _tensors(out) if _address(t) not in input_storages]
        if not written and not fresh:
            return  # a view: no data touched
        for t in fresh:
            self._fresh(t)
        written_ids = {id(t) for t in written}
        reads = self._ranges(t for t in inputs if id(t) not in written_ids)
        writes = self._ranges([*written, *fresh])
        thread = self._thread
        # by what it reads: a result computed from host tensors is tagged host only once the op returned
        # the host step's worker issues device work only inside a stream of its own (``use``): the
        # write-backs and refreshes that start as it steps each bucket (``buckets/copies_back.py``)
        issues_kernels = thread == 0 or getattr(self._local, "streamed", 0) > 0
        on_device = issues_kernels and (not inputs or any(not device_roles.is_host(t) for t in inputs))
        if not on_device:
            self._record(HostOp(thread, name, reads, writes))
            return
        stream = self.current_stream()
        if name in _HOST_SYNCS:
            self._record(HostWait(thread, name, stream=stream.id))
            self._record(HostOp(thread, name, reads, writes))
            return
        self._record(Kernel(thread, stream.id, name, reads, writes))
        for number, _, _ in writes:
            self._device_writer[number] = stream.id
        if name == "copy_" and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            if any(device_roles.is_host(t) for t in inputs):  # a synchronous copy between host and device
                self._record(HostWait(thread, "synchronous copy", stream=stream.id))

    def host_read(self, tensor: Tensor, name: str) -> None:
        """The host reads ``tensor``'s values outside torch's dispatch (``.tolist()``, ``.numpy()``)."""
        thread = self._thread
        if thread == 0 and not device_roles.is_host(tensor):
            self._record(HostWait(thread, name, stream=self.current_stream().id))
        self._record(HostOp(thread, name, self._ranges([tensor])))

    def _tagged_host(self, tensor: Tensor) -> None:
        """``tensor`` became host memory (``device_roles.mark_host``, or computed from host tensors):
        where a device kernel wrote it last, that was a copy to the host (``.to(host)``), which
        blocks the host until it landed."""
        address = _address(tensor)
        if not address:
            return
        number = self._buffer(address, tensor)
        self.trace.buffers[number] = self.trace.buffers[number].replace("device ", "host ", 1)
        stream = self._device_writer.pop(number, None)
        if stream is not None and self._thread == 0:
            self._record(HostWait(self._thread, "copy to the host", stream=stream))

    def host_waits_for_copy(self, name: str) -> None:
        """A copy to the host just issued on the current stream blocks the host until it landed."""
        if self._thread == 0:
            self._record(HostWait(self._thread, f"{name} to the host", stream=self.current_stream().id))

    def _fresh(self, t: Tensor) -> None:
        address = _address(t)
        if address:
            self._new_buffer(address, t)

    def _new_buffer(self, address: int, t: Tensor) -> int:
        number = next(self._buffer_ids)
        storage = t.untyped_storage()
        self._buffers[address] = (number, storage._cdata, storage.nbytes())
        where = "host" if device_roles.is_host(t) else "device"
        self.trace.buffers[number] = f"{where} {t.dtype} {tuple(t.shape)}"
        return number

    def _buffer(self, address: int, t: Tensor) -> int:
        """The buffer ``t`` (at ``address``) is in: a storage allocated where dispatch does not see it
        (a storage grown again) at the address of a freed one is another buffer."""
        known = self._buffers.get(address)
        storage = t.untyped_storage()
        if known is None or known[1:] != (storage._cdata, storage.nbytes()):
            return self._new_buffer(address, t)
        return known[0]

    def _ranges(self, tensors: Any) -> tuple[Range, ...]:
        ranges = []
        for t in tensors:
            address = _address(t)
            if not address or t.numel() == 0:
                continue
            number = self._buffer(address, t)
            size = t.element_size()
            start = t.storage_offset() * size
            span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
            ranges.append((number, start, start + span * size))
        return tuple(ranges)


class _SimWork:
    """A collective's work on the simulated device: waiting makes the current stream wait for it."""

    def __init__(self, device: SimulatedDevice, number: int, seq: int) -> None:
        self._device, self._number, self._seq = device, number, seq

    def wait(self) -> None:
        self._device.collective_waited(self._number, self._seq)

    def is_completed(self) -> bool:
        return True  # never asked on NCCL's path (a wait there orders streams)


class _Kernels(TorchDispatchMode):
    def __init__(self, device: SimulatedDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(getattr(t.__torch_dispatch__, "__func__", t.__torch_dispatch__) is not _PLAIN_DISPATCH for t in types):
            return NotImplemented  # a tensor subclass (the gradient view) runs its own ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = self.device
        if device.recording and not getattr(device._local, "muted", False):
            device.kernel(func, args, kwargs, out)
        return out


class _BlockingReads(TorchFunctionMode):
    """Reads of a tensor's values that torch does not dispatch (``tolist``, ``numpy``), and copies to
    the host that block it (``.to("cpu")``, ``.cpu()`` of a device tensor: its result is tagged host
    by ``device_roles`` once it returns)."""

    def __init__(self, device: SimulatedDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        device = self.device
        if func in (Tensor.tolist, Tensor.numpy) and device.recording and isinstance(args[0], Tensor):
            device.host_read(args[0], func.__name__)
        result = func(*args, **kwargs)
        if func in (Tensor.to, Tensor.cpu) and device.recording and isinstance(result, Tensor) and result is not args[0]:
            if device_roles.is_host(result) and not device_roles.is_host(args[0]) and not kwargs.get("non_blocking"):
                device.host_waits_for_copy(func.__name__)
        return result


def _tensors(tree: Any) -> list[Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor)]


def _address(t: Tensor) -> int:
    """Where ``t``'s storage starts (0: none, or 0 bytes)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0
    return storage.data_ptr() if storage.nbytes() else 0


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors ``func`` writes in place (its ``self`` of an in-place op, its ``out=``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written.extend(_tensors(value))
    return written

"""Communication buffers, allocated once and reused step after step.

Every bucket collective needs a flat buffer the size of the whole bucket: the reduce-scatter's
input (N, S + F) and the all-gather's output (N * S). Allocating them per collective costs an
allocation, and on the host fresh pages, every time; keeping one per bucket for good would cost a
full copy of the gradients at stage 2. So buffers come from one pool per engine that keeps a few
byte buffers the size of the largest regular bucket (stage 3: unit) and lends views of them: after
the first step, every bucket's collective reuses them. A larger request (a parameter bigger than a
bucket, stage 3's root unit) gets a buffer of its own for that collective, freed after.

A buffer is lent with :meth:`BufferPool.take` and comes back with :meth:`BufferPool.give_back` once
its collective has finished and its contents were copied out; the bucket's ``Pending*`` result
carries it until then, so a buffer is never written while a collective still reads or fills it.
On CUDA a buffer comes back with an event: the one recorded on the stream that gives it back (the
compute stream for the all-gathers, the reduce stream for the reduce-scatters, see [Note: reduce
stream] in ``reduce_stream.py``), or that of a copy on another stream that still reads it
(``copy_stream.py``); its next borrower's stream waits for that event, so reuse is ordered on the
device, never by a host sync.

[Note: a free list per stream]
On CUDA the pool keeps the buffers given back on each stream apart, and lends each stream only its
own (allocating when it has none): a reduction's buffer comes back as soon as the reduce stream is
told to wait for its reduce-scatter, which may be long before that collective can complete (a peer
still in its backward, or one that skipped the bucket's units and launches it only after its
backward). Lent to a stage-3 all-gather, the compute stream would wait for that event, and the peer
may need exactly that all-gather to go on: a cycle on the device. Within one stream, waiting for the
previous user's event only keeps the stream's own order. On the CPU there is one list per device."""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm.streams import DeviceStreams, Event, streams_of


class BufferPool:
    """Lends flat buffers of up to ``capacity_bytes`` from at most ``slots`` kept byte buffers.

    Any dtype is served from the same byte buffers (a view of the first ``numel`` elements), so
    buckets of different sizes share them. A request larger than ``capacity_bytes`` gets a buffer
    allocated for it alone, freed when given back.
    """

    def __init__(self, capacity_bytes: int, slots: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.slots = slots
        self._free: dict[tuple[torch.device, int], list[tuple[Tensor, Event]]] = {}  # by (device, stream): byte buffer, event to wait for
        self._lent: dict[int, Tensor] = {}  # data pointer of a lent view -> its byte buffer
        self._devices: dict[torch.device, tuple[Optional[DeviceStreams], Hashable]] = {}
        """Per device asked for: its streams (``streams_of``, asked once, as ``ReduceStream`` does) and,
        without streams, the key of its one free list (no key made per buffer lent)."""
        self.allocations = 0
        """Byte buffers the pool has allocated: flat after the first step."""
        self.oversized = 0
        """Requests larger than ``capacity_bytes`` served by a buffer of their own (each one counts)."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1D ``dtype`` buffer of ``numel`` elements on ``device``, contents undefined."""
        nbytes = numel * dtype.itemsize  # a property of the dtype: no tensor made per call
        if nbytes > self.capacity_bytes:
            self.oversized += 1
            return torch.empty(numel, dtype=dtype, device=device)
        streams, key = self._devices.get(device) or self._device(device)
        if streams is not None:
            key = streams.stream_key(streams.current_stream())  # see [Note: a free list per stream]
        free = self._free.setdefault(key, [])
        if free:
            base, copy = free.pop()
            if copy is not None:
                streams.wait_event(streams.current_stream(), copy)
            storage = base.untyped_storage()
            if storage.nbytes() == 0:  # its memory was handed back (``release_idle``)
                storage.resize_(self.capacity_bytes)
        else:
            self.allocations += 1
            base = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=device)
        view = base[:nbytes].view(dtype)
        self._lent[view.data_ptr()] = base
        return view

    def give_back(self, buffer: Tensor, after: Event = None) -> None:
        """Return a buffer from :meth:`take` once nothing queued afterwards on the current stream
        reads or fills it; ``after``: the event of a copy on another stream that still may (one
        that waited for the current stream first). On CUDA without ``after``, the event marks
        where the current stream is now."""
        base = self._lent.pop(buffer.data_ptr(), None)
        if base is None:
            return  # allocated for one oversized request: freed with its last reference
        streams, key = self._devices.get(base.device) or self._device(base.device)
        if streams is not None:
            key = streams.stream_key(streams.current_stream())  # see [Note: a free list per stream]
        free = self._free.setdefault(key, [])
        if len(free) < self.slots:
            if after is None and streams is not None:
                after = streams.record_event(streams.current_stream())
            free.append((base, after))

    def release_idle(self) -> None:
        """Hand back the memory of every byte buffer not lent now; each keeps its size and takes
        memory again when next lent (as a stage-3 storage is grown for each gather). Called where no
        collective is in flight until the next pass (after backward), so that what comes between,
        the optimizer step (a rank's peak), holds no idle communication buffer: FSDP2 frees its
        gather and reduction buffers after each use, and a pool that kept them cost a ZeRO-3 rank
        a block of a model at a given memory (issue 60). On a device with streams the memory goes
        back to the allocator after the current stream waited for the buffer's last reader."""
        for free in self._free.values():
            for i, (base, event) in enumerate(free):
                storage = base.untyped_storage()
                if storage.nbytes() == 0:
                    continue
                if event is not None:  # a reader on another stream: the allocator reuses it after that
                    streams = streams_of(base.device)
                    streams.wait_event(streams.current_stream(), event)
                    streams.keep_alive(base, streams.current_stream())
                    free[i] = (base, None)
                storage.resize_(0)

    @property
    def kept_bytes(self) -> int:
        """Bytes the pool's byte buffers hold now (free or lent out; a released one holds none)."""
        bases = [base for f in self._free.values() for base, _ in f] + list(self._lent.values())
        return sum(base.untyped_storage().nbytes() for base in bases)

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
        self._devices.clear()

    def _device(self, device: torch.device) -> tuple[Optional[DeviceStreams], Hashable]:
        """``device``'s streams, and the key of its free list where it has none (on a device with
        streams, each stream has its own: see [Note: a free list per stream])."""
        known = self._devices[device] = (streams_of(device), (torch.device(device), 0))
        return known

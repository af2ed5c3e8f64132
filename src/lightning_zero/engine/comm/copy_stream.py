"""Copies between host memory and the device, off the compute stream.

On a device with streams (CUDA; see [Note: the stream layer] in ``streams.py``) copies run on two
side streams, one per direction, ``non_blocking`` between pinned host memory and the device, so they
overlap backward and forward (and each other, on a bus that copies both ways at once):

- device → host (``to host``): the stream first waits for the stream the data was produced on (the
  compute stream, or the reduce stream for a reduced row) and for every copy to the device issued
  before, so a host buffer a copy to the device still reads is not written before that read; the
  host reads the copy only after it waited for it, once per backward (with
  :meth:`CopyStream.synchronize`, or within the backward's one read: :meth:`CopyStream.join_compute_stream`),
  or on the host step's thread (:meth:`CopyStream.wait_on_host`).
- host → device (``to device``): the copy lands in a buffer allocated on its stream, so it starts at
  once instead of after the compute queued before it; the compute stream waits for the copy's event
  only where the data is used (never the host), and the buffer is not reused before that use ends.

[Note: one stream per direction]
The copies to the device must never wait for a gradient reduction. A reduced row goes to the host
as its reduce-scatter finishes during backward, and its copy waits for that reduce-scatter; at stage
3 with parameters offloaded (and no device copy of the chunks, fp32 weights) every gather of backward
sends its chunks through a copy to the device, which the compute stream waits for. On one stream the
compute stream would so wait for reduce-scatters mid-backward, and a peer that launches a bucket only
after its backward (its backward did not reach it) would need this rank's gathers first: a cycle
between the two devices (review N2; ``tests/test_schedules.py`` finds it on one stream). With the
copies to the device on their own stream, nothing the compute stream waits for waits for a reduction.

A device buffer a copy reads or fills is handed back to its pool with the copy's event, so the
pool's next user waits for the copy on the device (see ``buffers.py``).

Elsewhere (CPU training, where "host" and "device" are the same memory) copies are plain and
synchronous, and the same code runs without streams or events.

What the copies hold beside model state, the pinned host blocks of their buffers and the device rows
they land in, is counted for the memory report in ``copy_memory.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.engine.comm.copy_memory import DeviceTemporaries, PinnedBlocks
from lightning_zero.engine.comm.streams import Event, streams_of
from lightning_zero.engine.device_roles import mark_host


class CopyStream:
    """Host↔device copies for one compute ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._streams = streams_of(self.device)
        self._to_host = self._streams.new_stream("to host") if self._streams is not None else None
        self._to_device = self._streams.new_stream("to device") if self._streams is not None else None
        self.pinned = self._streams is not None and self._streams.pins_host_memory
        """Whether host buffers for these copies are pinned (page-locked): what makes CUDA copies
        asynchronous and as fast as the bus."""
        self._unwaited: list = []  # the streams with copies issued since the host last waited for them
        self.pinned_blocks = PinnedBlocks()
        """The pinned host blocks of the buffers these copies read and fill (see [Note: pinned
        blocks] in ``copy_memory.py``)."""
        self.temporaries = DeviceTemporaries(
            self._compute_event if self._streams is not None else None, self._streams.is_done if self._streams is not None else None
        )
        """The device rows :meth:`to_device` lands copies in, until the compute stream has read them."""

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1D host buffer (contents undefined) for these copies to read or fill: ``host_empty``,
        its pinned block counted in ``pinned_blocks``."""
        buffer = host_empty(numel, dtype, self.pinned)
        if self.pinned:
            self.pinned_blocks.taken(buffer.untyped_storage().nbytes())
        return buffer

    def to_host(self, host: Tensor, device_data: Tensor) -> Event:
        """Copy ``device_data`` (ready on the current stream) into ``host`` (pinned, same shape and
        dtype). The host may read ``host`` only after :meth:`synchronize` or :meth:`wait_on_host`."""
        if self._to_host is None:
            host.copy_(device_data)
            return None
        streams, stream = self._streams, self._to_host
        streams.wait_stream(stream, streams.current_stream())
        streams.wait_stream(stream, self._to_device)  # host memory read by a copy to the device is not overwritten early
        self._issued(stream)
        with streams.use(stream):
            host.copy_(device_data, non_blocking=True)
            streams.keep_alive(device_data, stream)  # for a buffer freed (not pooled) before the copy ran
            # blocking: the host-step worker sleeps on it through backward instead of spinning a core
            return streams.record_event(stream, blocking=True)

    def to_device(self, host: Tensor) -> Tensor:
        """A device copy of ``host`` (pinned), for kernels issued on the compute stream after this
        call to read; the host does not wait. Where host and device are one memory: ``host``."""
        if self._to_device is None:
            return host.to(self.device)  # ``host`` itself where it is on the device already
        streams, stream = self._streams, self._to_device
        compute = streams.current_stream()
        self._issued(stream)
        with streams.use(stream):
            device_data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            device_data.copy_(host, non_blocking=True)
            event = streams.record_event(stream)
        self.temporaries.add(device_data)
        streams.wait_event(compute, event)
        streams.keep_alive(device_data, compute)  # its memory is not reused before the compute stream is done with it
        return device_data

    def wait_on_host(self, copy: Event) -> None:
        """The calling host thread blocks until ``copy`` (from ``to_host``) landed: for a thread
        other than the one running backward, which must never wait."""
        if copy is not None:
            self._streams.host_waits(copy)

    def synchronize(self) -> None:
        """The host waits for every copy issued so far: before it reads what came to the host, and
        before it writes host memory a copy to the device may still read (the optimizer step). No
        wait (no host sync) when nothing was issued since the last one."""
        for stream in self._unwaited:
            self._streams.host_waits(stream)
        self._unwaited.clear()

    def join_compute_stream(self) -> None:
        """Instead of :meth:`synchronize`, where the host reads a device value right after this
        call (``HostReads.read``): the compute stream waits for every copy issued so far, on the
        device, so that the read's one host sync waits for the copies too. The caller must make
        that read before it touches host memory the copies fill or read."""
        for stream in self._unwaited:
            self._streams.wait_stream(self._streams.current_stream(), stream)
        self._unwaited.clear()

    def _issued(self, stream: object) -> None:
        if stream not in self._unwaited:
            self._unwaited.append(stream)

    def _compute_event(self) -> Event:
        return self._streams.record_event(self._streams.current_stream())


def host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> Tensor:
    """A 1D host buffer (contents undefined), pinned when copies to a CUDA device read or fill it."""
    return mark_host(torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned))

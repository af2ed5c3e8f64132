"""Copies between host memory and the device, off the compute stream.

On a device with streams (CUDA; see [Note: the stream layer] in ``streams.py``) every copy runs on one side stream, ``non_blocking`` between pinned host memory and the
device, so it overlaps backward and forward:

- device → host: the copy stream first waits for the compute stream (the data is produced there);
  the host reads the copy only after it waited for the copy stream, once per backward (with
  :meth:`CopyStream.synchronize`, or within the backward's one read: :meth:`CopyStream.join_compute_stream`).
- host → device: the copy lands in a buffer allocated on the copy stream, so it starts at once
  instead of after the compute queued before it; the compute stream waits for the copy's event
  only where the data is used (never the host), and the buffer is not reused before that use ends.

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
        self._stream = self._streams.new_stream("copies") if self._streams is not None else None
        self.pinned = self._streams is not None and self._streams.pins_host_memory
        """Whether host buffers for these copies are pinned (page-locked): what makes CUDA copies
        asynchronous and as fast as the bus."""
        self._unwaited = False  # copies issued since the host last waited for them
        self.pinned_blocks = PinnedBlocks()
        """The pinned host blocks of the buffers these copies read and fill (see [Note: pinned
        blocks] in ``copy_memory.py``)."""
        self.temporaries = DeviceTemporaries(
            self._compute_event if self._stream is not None else None, self._streams.is_done if self._streams is not None else None
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
        """Copy ``device_data`` (ready on the compute stream) into ``host`` (pinned, same shape and
        dtype). The host may read ``host`` only after :meth:`synchronize`."""
        if self._stream is None:
            host.copy_(device_data)
            return None
        streams = self._streams
        streams.wait_stream(self._stream, streams.current_stream())
        self._unwaited = True
        with streams.use(self._stream):
            host.copy_(device_data, non_blocking=True)
            streams.keep_alive(device_data, self._stream)  # for a buffer freed (not pooled) before the copy ran
            # blocking: the host-step worker sleeps on it through backward instead of spinning a core
            return streams.record_event(self._stream, blocking=True)

    def to_device(self, host: Tensor) -> Tensor:
        """A device copy of ``host`` (pinned), for kernels issued on the compute stream after this
        call to read; the host does not wait. Where host and device are one memory: ``host``."""
        if self._stream is None:
            return host.to(self.device)  # ``host`` itself where it is on the device already
        streams = self._streams
        compute = streams.current_stream()
        self._unwaited = True
        with streams.use(self._stream):
            device_data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            device_data.copy_(host, non_blocking=True)
            event = streams.record_event(self._stream)
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
        if self._stream is not None and self._unwaited:
            self._streams.host_waits(self._stream)
            self._unwaited = False

    def join_compute_stream(self) -> None:
        """Instead of :meth:`synchronize`, where the host reads a device value right after this
        call (``HostReads.read``): the compute stream waits for every copy issued so far, on the
        device, so that the read's one host sync waits for the copies too. The caller must make
        that read before it touches host memory the copies fill or read."""
        if self._stream is not None and self._unwaited:
            self._streams.wait_stream(self._streams.current_stream(), self._stream)
            self._unwaited = False

    def _compute_event(self) -> Event:
        return self._streams.record_event(self._streams.current_stream())


def host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> Tensor:
    """A 1D host buffer (contents undefined), pinned when copies to a CUDA device read or fill it."""
    return mark_host(torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned))

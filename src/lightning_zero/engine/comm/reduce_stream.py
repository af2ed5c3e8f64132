"""The stream gradient reductions run on, so that launching one never waits for the device.

[Note: reduce stream]
A bucket's reduce-scatter is launched the moment its gradients are ready (DDP's and FSDP's rule),
never once the host has seen an earlier one complete: on a GPU the host runs ahead of the device,
so it sees a completion late, and launches gated on it slip toward the end of backward while the
ready buckets' full gradients wait (issue 52). The order comes from the device instead:

- **copy-in**: the reduce stream waits for the compute stream (which produced the gradients), then
  packs them, scaled, into the send buffer and issues the collective, both on the reduce stream;
  each gradient read there is kept alive for it (``record_stream``), since its ``param.grad`` is
  dropped right after on the host;
- **buffer reuse**: finishing a reduction makes the reduce stream (not the host, not the compute
  stream) wait for the collective, and its buffers go back to the pool with an event recorded
  there, which the buffer's next borrower waits for on its own stream (``buffers.py``);
- **hybrid sharding**: the all-reduce across the replicas is issued right after the
  reduce-scatter, on the same stream, so stream order chains them;
- **the results**: the compute stream waits for the reduce stream once, in ``finish_backward``,
  before anything reads a gradient shard.

On the CPU there are no streams: the same code runs with none, and gloo's waits block the host.
Where a wait blocks the host (gloo, or NCCL with ``TORCH_NCCL_BLOCKING_WAIT``), a rank must not
wait inside backward for a peer that may not have launched the same collective (see [Note: no
waiting in backward] in ``grad_sync.py``); there a reduction is finished during backward only
once its collective has completed (which the host sees without lag, since it is the device).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm.streams import Stream, streams_of


class ReduceStream:
    """The gradient reductions' side stream on a ``device`` with streams (CUDA, or a simulated
    device: see [Note: the stream layer] in ``streams.py``); on any other device a stand-in whose
    methods do nothing (the reductions then run where they are called)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._streams = streams_of(self.device)
        self._stream: Optional[Stream] = self._streams.new_stream("reduce") if self._streams is not None else None
        self._launched = False  # a reduction ran on the stream since the compute stream last joined it

    @property
    def stream(self) -> Optional[Stream]:
        return self._stream

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Run the body (a reduction's copy-in and collective) on the reduce stream, after every
        kernel the compute stream has queued so far (the gradients it reads were produced there)."""
        if self._stream is None:
            yield
            return
        self._streams.wait_stream(self._stream, self._streams.current_stream())
        self._launched = True
        with self._streams.use(self._stream):
            yield

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """Run the body (a reduction's wait and what follows it) on the reduce stream, without
        waiting for the compute stream: a wait there holds back only later reductions."""
        if self._stream is None:
            yield
            return
        with self._streams.use(self._stream):
            yield

    def keep_alive(self, tensors: Sequence[Tensor]) -> None:
        """Tell the allocator that the reduce stream reads ``tensors`` (produced on the compute
        stream), so that their memory is not handed out again before what is queued there ran,
        however soon the host drops them."""
        if self._stream is not None:
            for tensor in tensors:
                self._streams.keep_alive(tensor, self._stream)

    def join(self) -> None:
        """The compute stream waits for every reduction issued so far (on the device; the host
        goes on): from here kernels on it may read the reduced gradients."""
        if self._stream is not None and self._launched:
            self._streams.wait_stream(self._streams.current_stream(), self._stream)
            self._launched = False

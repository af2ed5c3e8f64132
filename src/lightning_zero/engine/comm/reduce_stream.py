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
  before anything reads a gradient shard;
- **its lag** (review N4): a launched bucket's full gradients stay allocated until its copy-in ran on
  the reduce stream. Where communication is slower than compute (several nodes without a fast
  network, PCIe-only GPUs, a slow peer) the reduce stream falls behind through backward; with the
  gradients only kept alive for it (``record_stream``), the allocator reuses none of them before the
  reduce stream got there, so up to every full gradient is alive at the end of backward (stage 1's
  memory, invisible to the host). So a launch may be ``bounded``: its gradients are not kept alive
  for the reduce stream but held by the host, and at the launch ``max_in_flight`` launches later the
  compute stream waits for its copy-in (an event) and the host drops them: they are freed in the
  compute stream's order, after that wait, and the allocator reuses them at once (FSDP2 bounds its
  reduce-scatter the same way). At most ``max_in_flight + 1`` buckets' full gradients then wait for
  the reduce stream, however far it lags. A launch is bounded only where every rank launches every
  bucket during its backward (see [Note: unreached parameters] in ``unreached.py``): the copy-in sits
  behind the reduce stream's waits for earlier reduce-scatters, and where a peer may launch a bucket
  only after its backward, the compute stream must not wait for it (the peer may need this rank's
  all-gathers to get there: a cycle across the ranks).

On the CPU there are no streams: the same code runs with none, and gloo's waits block the host.
Where a wait blocks the host (gloo, or NCCL with ``TORCH_NCCL_BLOCKING_WAIT``), a rank must not
wait inside backward for a peer that may not have launched the same collective (see [Note: no
waiting in backward] in ``grad_sync.py``); there a reduction is finished during backward only
once its collective has completed (which the host sees without lag, since it is the device).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm.streams import Event, Stream, streams_of


class ReduceStream:
    """The gradient reductions' side stream on a ``device`` with streams (CUDA, or a simulated
    device: see [Note: the stream layer] in ``streams.py``); on any other device a stand-in whose
    methods do nothing (the reductions then run where they are called)."""

    def __init__(self, device: torch.device, max_lag: int = 2) -> None:
        self.device = torch.device(device)
        self.max_lag = max_lag
        """Bounded launches the reduce stream may have left to copy in when the compute stream goes on."""
        self._streams = streams_of(self.device)
        self.stream: Optional[Stream] = self._streams.new_stream("reduce") if self._streams is not None else None
        """The reduce stream (None: none, the reductions run where they are called); an attribute,
        read once per reduction."""
        self._launched = False  # a reduction ran on the stream since the compute stream last joined it
        self._current: Optional[_Launch] = None  # the launch being issued
        self._launches: list[_Launch] = []  # since the compute stream last joined, the ones not yet let go
        self._peak = 0
        self.last_peak = 0
        """The most bytes of full gradients launched and not yet seen copied in (events queried at each
        launch) since the compute stream last joined: the reduce stream's lag, as it was."""

    def launching(self, bounded: bool = False) -> contextlib.AbstractContextManager:
        """Run the body (a reduction's copy-in and collective) on the reduce stream, after every
        kernel the compute stream has queued so far (the gradients it reads were produced there).
        ``bounded``: the gradients read count against the lag's bound (see "its lag" above).
        (Contexts of small classes, not generators: one per reduction, see ``_Launching``.)"""
        return _Launching(self, bounded) if self.stream is not None else _NOTHING

    def finishing(self) -> contextlib.AbstractContextManager:
        """Run the body (a reduction's wait and what follows it) on the reduce stream, without
        waiting for the compute stream: a wait there holds back only later reductions."""
        return self._streams.use(self.stream) if self.stream is not None else _NOTHING

    def _begin_launch(self, bounded: bool) -> "_Launch":
        self._streams.wait_stream(self.stream, self._streams.current_stream())
        self._launched = True
        launch = self._current = _Launch(bounded)
        return launch

    def _end_launch(self, launch: "_Launch") -> None:
        launch.packed = self._streams.record_event(self.stream)
        self._launched_one(launch)

    def _launched_one(self, launch: "_Launch") -> None:
        """After a launch: bound the lag (the compute stream waits for the copy-in of the bounded
        launch ``max_lag`` bounded launches back, whose gradients then go), and measure it."""
        self._launches.append(launch)
        bounded = [earlier for earlier in self._launches if earlier.bounded]
        if launch.bounded and len(bounded) > self.max_lag:
            oldest = bounded[-self.max_lag - 1]
            self._streams.wait_event(self._streams.current_stream(), oldest.packed)
            for earlier in self._launches[: self._launches.index(oldest) + 1]:
                earlier.held.clear()  # freed in the compute stream's order, after the wait
        streams = self._streams
        self._launches = [earlier for earlier in self._launches if earlier.held or not streams.is_done(earlier.packed)]
        # what the reduce stream's lag holds now: a bounded launch's gradients until the host lets them
        # go (then the compute stream's order frees them), an unbounded one's until its copy-in ran
        alive = [e for e in self._launches if e.held or (not e.bounded and not streams.is_done(e.packed))]
        self._peak = max(self._peak, sum(e.nbytes for e in alive))

    def keep_alive(self, tensors: Sequence[Tensor]) -> None:
        """The reduce stream reads ``tensors`` (produced on the compute stream): their memory is not
        handed out again before it did, however soon the host drops them (inside a bounded launch:
        the host holds them until the compute stream waited for their copy-in)."""
        if self.stream is None:
            return
        launch = self._current
        if launch is not None:
            launch.nbytes += sum(t.numel() * t.element_size() for t in tensors)
            if launch.bounded:
                launch.held.extend(tensors)
                return
        for tensor in tensors:
            self._streams.keep_alive(tensor, self.stream)

    def join(self) -> None:
        """The compute stream waits for every reduction issued so far (on the device; the host
        goes on): from here kernels on it may read the reduced gradients."""
        if self.stream is not None and self._launched:
            self._streams.wait_stream(self._streams.current_stream(), self.stream)
            self._launched = False
            self._launches.clear()  # what they held is freed in the compute stream's order, after the join
            self.last_peak, self._peak = self._peak, 0


_NOTHING = contextlib.nullcontext()
"""The context of a reduction without a stream: the body runs where it is called."""


class _Launching:
    """``ReduceStream.launching``'s context on a device with streams: the launch begins (the reduce
    stream waits for the compute stream) on entry, the body runs on the reduce stream, and a body
    that returned ends it (its event recorded, the lag bounded)."""

    def __init__(self, reduce: ReduceStream, bounded: bool) -> None:
        self._reduce, self._bounded = reduce, bounded

    def __enter__(self) -> None:
        reduce = self._reduce
        self._launch = reduce._begin_launch(self._bounded)
        self._on_stream = reduce._streams.use(reduce.stream)
        self._on_stream.__enter__()

    def __exit__(self, *exc: object) -> bool:
        try:
            self._on_stream.__exit__(*exc)
        finally:
            self._reduce._current = None
        if exc[0] is None:
            self._reduce._end_launch(self._launch)
        return False


@dataclass
class _Launch:
    bounded: bool
    packed: Event = None
    """Recorded on the reduce stream after the launch: its copy-in ran."""
    held: list[Tensor] = field(default_factory=list)
    """The full gradients of a bounded launch, held until the compute stream waited for ``packed``."""
    nbytes: int = 0
    """The full gradients' bytes it reads."""

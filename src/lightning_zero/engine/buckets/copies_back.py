"""Stages 1-2 with CPU offload: a bucket's write-back as soon as its host step ran during backward.

[Note: copies back per bucket]
With the host step during backward (``offload/step_ahead.py``) a bucket's master chunks are stepped
while the device computes the earlier layers' gradients. What remained after ``optimizer.step()`` was
the write-back: each bucket's stepped chunks copied to the device and all-gathered into the full
parameters, the larger half of what stepping during backward still left exposed. Here the host step's
thread starts that write-back as soon as it stepped a bucket:

- **the same collectives on every rank, in the same order**: a *round* is one all-gather per bucket
  (every bucket of the optimizer, stepped or not), in bucket order, on a process group of their own
  (``ReplicatedParameters``' write-back group). The round opens before every backward that steps, on
  every rank alike. A rank sends a bucket's gather as soon as its step ran (early, on the host step's
  thread) or at ``close`` (after ``optimizer.step()``); which one is the rank's business: a gather
  completes once every rank sent it, with each rank's final chunk. Sends are a prefix of the bucket
  order, so the order never depends on when a rank's steps finish, and a rank that stepped nothing
  ahead (switched off, backing off, its own verdict) sends everything at ``close``.
- **never blocking backward**: the host step's thread only starts gathers (at most ``IN_FLIGHT``
  unfinished) and finishes those already complete (a gloo gather waits for every rank's send; a
  NCCL one only orders streams). ``close`` sends the rest of the round and finishes every gather.
- **streams** (CUDA): the thread issues on a write-back stream of its own, which first waits for
  the bucket's gradient row to have left the device (so backward's last reads of those parameters
  ran); the compute stream waits for the write-back stream at ``close``, before anything reads the
  parameters again.
- **a step undone after its chunks were sent** (a redone step, a bucket's chunks read before the
  verdict, no ``optimizer.step()`` at all): its rank's parameters hold chunks the step no longer
  has. Where that can happen (the adapter keeps rollback copies), ``close`` asks every rank (one
  all-reduce of a flag) and, if any is stale, every rank gathers every bucket again. Where no
  rollback is kept, no step can be undone (a verdict that fails raises).
- **when not**: where user code may run between backward and the step (the adapter's
  ``check_contents``), the round is not opened: a hook there reads the parameters as DDP shows them,
  before the step, and a weight it reads to edit a gradient would otherwise be the stepped one, a
  difference no verdict sees. Holding the gathered weights aside until the verdict would cost a
  second copy of the model on the device. The write-back then runs after the step, as before.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import deque
from typing import Optional, Protocol, Sequence

import torch

from lightning_zero.engine.buckets.bucket import Bucket, PendingParamGather
from lightning_zero.engine.buckets.pipelining import finish_pipelined
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.streams import Event, streams_of
from lightning_zero.engine.offload.host_chunks import HostChunks

IN_FLIGHT = 2
"""Gathers the host step's thread leaves unfinished at most (each holds a bucket's gathered row)."""


class SentStep(Protocol):
    """A bucket's step as the host step's thread ran it (``offload.bucket_step.BucketStep``)."""

    stepped: bool
    undone: bool
    """Rolled back since (a redo, a read of its chunks before the verdict, a step that never came)."""


def largest_over_ranks(bucket: Bucket, value: float) -> float:
    """The largest of every rank's ``value`` (all of the engine's ranks: ``bucket``'s shard group, then
    across its replicas), for a decision every rank must take alike."""
    largest = torch.tensor([value], dtype=torch.float64, device=bucket.device)
    collectives.all_reduce(largest, bucket.group, op="max")
    if bucket.replicate_group is not None:
        collectives.all_reduce(largest, bucket.replicate_group, op="max")
    return float(largest.item())


class CopiesBack:
    """Rounds of write-back all-gathers over ``buckets`` (see [Note: copies back per bucket])."""

    def __init__(self, buckets: Sequence[Bucket], device: torch.device) -> None:
        self.buckets = list(buckets)
        self._position = {id(b.host): i for i, b in enumerate(self.buckets)}
        self._streams = streams_of(device)
        self._stream = self._streams.new_stream("write back") if self._streams is not None else None
        self._waits_block_host = bool(self.buckets) and collectives.waits_block_host(self.buckets[0].gather_group, device)
        self.pool = BufferPool(capacity_bytes=max((b.buffer_bytes for b in self.buckets), default=0), slots=IN_FLIGHT)
        """The gathered rows of the thread's gathers (device memory: ``IN_FLIGHT`` buckets' worth)."""
        self._lock = threading.Lock()
        self.round_open = False
        self.may_undo = False
        """Whether a step sent early may be undone this round (the adapter keeps rollback copies)."""
        self._ran: dict[int, tuple[Optional[SentStep], Event]] = {}
        """Per bucket position: its step this round (None: nothing stepped) and its row's copy."""
        self._sent = 0
        """Buckets ``[0, _sent)`` of this round have been sent."""
        self._early: list[Optional[SentStep]] = []
        self._unfinished: deque[PendingParamGather] = deque()
        self.sent_early = 0
        """Buckets sent by the host step's thread (counted for tests and reports)."""

    def open_round(self, may_undo: bool) -> None:
        """Before a backward that steps: every bucket is gathered once more, from now on."""
        with self._lock:
            self.round_open, self.may_undo = True, may_undo
            self._ran.clear()
            self._sent = 0
            self._early = []

    # ---- on the host step's thread --------------------------------------------------------------
    def ran(self, steps: Sequence[tuple[HostChunks, Optional[SentStep], Event]]) -> None:
        """``(host chunks, step or None, row copy)`` of each bucket the thread just took: send the
        buckets whose turn it is, and finish the gathers that completed."""
        if not self.round_open:
            return
        with self._lock:
            for host, step, copy in steps:
                self._ran[self._position[id(host)]] = (step, copy)
            self._send_ready()
            self._finish_completed()

    def _send_ready(self) -> None:
        while self._sent < len(self.buckets) and self._sent in self._ran and len(self._unfinished) < IN_FLIGHT:
            step, copy = self._ran[self._sent]
            bucket = self.buckets[self._sent]
            with self._on_stream(copy):
                pending = bucket.start_write_back(self.pool)
                if not self._waits_block_host:  # NCCL: finishing only orders the write-back stream
                    pending.finish()
                else:
                    self._unfinished.append(pending)
            self._early.append(step)
            self._sent += 1
            self.sent_early += 1

    def _finish_completed(self) -> None:
        while self._unfinished and self._unfinished[0].work.done():
            with self._on_stream(None):
                self._unfinished.popleft().finish()

    def _on_stream(self, after: Event):
        return _on_stream(self._streams, self._stream, after)

    # ---- on the training thread ------------------------------------------------------------------
    def close(self) -> None:
        """After the step (or where none came): send the rest of the round, finish every gather, and
        where some rank's parameters hold chunks of a step undone since, gather every bucket again.
        The host step's thread is idle (the caller waited for it). A collective: every rank calls it."""
        if not self.round_open:
            return
        with self._lock:
            self.round_open = False
            unfinished, rest = list(self._unfinished), self.buckets[self._sent :]
            self._unfinished.clear()
            early, self._early = self._early, []
        if self._stream is not None:  # the parameters' next readers, and later gathers, come after
            self._streams.wait_stream(self._streams.current_stream(), self._stream)
        for bucket in rest:
            bucket.full_targets.check_not_assigned()
        started = itertools.chain(unfinished, (b.start_param_gather() for b in rest))
        finish_pipelined(started, max(IN_FLIGHT, len(unfinished)))
        stale = float(any(step is not None and step.stepped and step.undone for step in early))
        if self.may_undo and self.buckets and largest_over_ranks(self.buckets[0], stale) > 0:
            finish_pipelined((b.start_param_gather() for b in self.buckets), IN_FLIGHT)

    @property
    def pool_bytes(self) -> int:
        """Device memory the host step's thread's gathers keep (``memory_report().comm_buffers``)."""
        return self.pool.kept_bytes

    def quiesce(self) -> None:
        """The host waits for the write-backs' copies from host memory: before it writes the master
        chunks they read (a rollback)."""
        if self._stream is not None:
            self._streams.host_waits(self._stream)

    def rolled_back(self, host: HostChunks) -> None:
        """A step undone: ``close`` finds it (``SentStep.undone``) and gathers again."""

    def release(self) -> None:
        self.pool.clear()


class ChunksBack:
    """Stage 3: each offloaded bucket's device chunks (half-precision weights, or parameters kept on
    the device) refreshed from its master chunks as soon as its host step ran during backward,
    instead of all of them after ``optimizer.step()``. No collective: a rank's refresh is its own.

    A gather of the chunks before the verdict (a unit backward never reached, a read at rest) must
    read them as before the step. Where they were not refreshed yet, the bucket is *held*: the
    thread leaves it to ``after_step``, and the step itself stands (what was read is the chunks
    before it). Where they were, the bucket's step is undone (``HostChunks.unsettled``, whose wait
    for the thread cannot wait on a peer: the step is done) and ``rolled_back`` brings the chunks
    back. The training thread never waits for a step still to come: that step may wait for a
    reduce-scatter that a peer reaches only after this very gather (the schedule explorer's
    ``stage3_bf16_offloaded_late_rank``)."""

    def __init__(self, buckets: Sequence[Bucket], device: torch.device) -> None:
        self._buckets = [b for b in buckets if b.host is not None and b.host.on_disk is None and b.host.device_chunks]
        self._streams = streams_of(device)
        self._stream = self._streams.new_stream("refresh") if self._streams is not None else None
        self._lock = threading.Lock()
        self._fresh: dict[int, SentStep] = {}
        """Per bucket (``id`` of its host chunks): the step its device chunks hold."""
        self._held: set[int] = set()
        """Buckets read before their refresh: refreshed after the step, not by the thread."""
        for bucket in self._buckets:
            bucket.host.before_device_read = functools.partial(self._before_device_read, bucket.host)
        self.refreshed_early = 0
        """Buckets refreshed by the host step's thread (counted for tests and reports)."""

    pool_bytes = 0
    """No buffers of its own: the refresh lands in the copies' rows (``copy_buffers``)."""

    def ran(self, steps: Sequence[tuple[HostChunks, Optional[SentStep], Event]]) -> None:
        for host, step, copy in steps:
            if step is None or not step.stepped or host.before_device_read is None:
                continue
            with self._lock:
                if id(host) in self._held:
                    continue
                with _on_stream(self._streams, self._stream, copy):
                    host.refresh_device_chunks(settle=False)
                self._fresh[id(host)] = step
            self.refreshed_early += 1

    def _before_device_read(self, host: HostChunks) -> None:
        with self._lock:
            refreshed = id(host) in self._fresh
            if not refreshed:
                self._held.add(id(host))
        if refreshed and host.unsettled is not None:
            host.unsettled()

    def quiesce(self) -> None:
        if self._stream is not None:
            self._streams.host_waits(self._stream)

    def rolled_back(self, host: HostChunks) -> None:
        """On the training thread, after ``host``'s step was undone: its device chunks as before it."""
        with self._lock:
            refreshed = self._fresh.pop(id(host), None) is not None
        if refreshed:
            self.quiesce()
            host.refresh_device_chunks(settle=False)

    def after_step(self, mine: set[int]) -> None:
        """After ``optimizer.step()``: refresh the buckets holding parameters in ``mine`` (ids) whose
        device chunks do not hold the step taken."""
        if self._stream is not None:  # the next gathers read what the refreshes wrote
            self._streams.wait_stream(self._streams.current_stream(), self._stream)
        with self._lock:
            fresh, self._fresh = self._fresh, {}
            self._held.clear()
        for bucket in self._buckets:
            step = fresh.get(id(bucket.host))
            if (step is None or step.undone) and any(id(p) in mine for p in bucket.params):
                bucket.host.refresh_device_chunks()

    def release(self) -> None:
        self._fresh.clear()
        self._held.clear()


def _on_stream(streams, stream, after: Event):
    """Work issued in the body goes to ``stream``, after ``after`` (a row's copy); none on the CPU."""
    if stream is None:
        return _NO_STREAM
    if after is not None:
        streams.wait_event(stream, after)
    return streams.use(stream)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NO_STREAM = _NoStream()

"""When gradients are reduce-scattered into the shards: the one difference between stages 1 and 2.

Both policies issue the buckets' reduce-scatters in one fixed order — the bucket list's — on every
rank, whatever order their gradients arrive in. Collectives are matched by issue order, so this is
what keeps ranks from deadlocking when a parameter is unused on some ranks only.

[Note: no waiting in backward]
A fixed order has a price when the ranks' backwards differ: a bucket holding a parameter that one
rank's backward never reaches (a unit it skips) is launched there only by the flush after its
backward, and every later bucket waits behind it. A peer that reached the bucket has launched it
and goes on launching the next ones. If it then *waited* for the oldest reduce-scatter in flight to
make room (the in-flight bound), it would wait inside its backward for the rank that skipped, and at
stage 3 that rank's backward needs the all-gathers of the units still ahead, which the waiting peer
issues only as its own backward reaches them: each waits on the other, on two process groups, until
the timeout. So during backward a rank never waits for a reduce-scatter (nor, with hybrid sharding,
for its all-reduce across replicas): launching one more only finishes the oldest once finishing it
cannot wait for a peer (``PendingGradientReduction.done``, which polls); until then the ready bucket
keeps its full gradients and is launched from a later gradient hook, or by the flush (so ``done``
must turn true once a collective has finished: on gloo the reduce-scatter is issued as all-reduces
whose works say so, ``collectives._reduce_scatter_gloo``; one that never did kept every bucket's
gradients until the flush, issue 44; ``memory_report().waiting_gradients`` is the most the last
backward held waiting). Waiting starts
in ``finish_backward``, after this rank's backward has issued every all-gather its peers may need
(``finish_backward_gathers``). The bound on communication buffers holds; what a rank skipping units
costs its peers is the full gradients of the buckets queued behind the skipped one, until it
flushes.

The same holds on NCCL, where ``wait`` does not block the host but makes the compute stream wait:
every all-gather this rank issues afterwards is queued behind that wait on the device, so waiting
for a reduce-scatter a peer has not joined forms the same cycle on the device (a hang until NCCL's
watchdog; with ``TORCH_NCCL_BLOCKING_WAIT=1`` on the host). ``done`` therefore asks whether the
collective has *completed* on every backend (on NCCL a query of its CUDA event, which never
blocks), never whether waiting would block the host. In the usual case, when every rank reaches
every bucket, this also keeps ``max_in_flight`` reductions overlapping backward instead of making
the compute stream wait for the oldest as soon as the next bucket is ready, which DDP never does
either. ``tests/test_nccl_semantics.py`` runs the ranks-skip-units cases of ``test_reliability.py``
with this decision, gloo's waits blocking where NCCL's would order streams.
"""

from __future__ import annotations

import abc
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.buckets.bucket import Bucket, PendingGradientReduction, hand_out_gradients
from lightning_zero.engine.buckets.pipelining import finish_pipelined
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.stop_vote import StopVote
from lightning_zero.engine.shards.sharded_param import ShardedParam


class GradientSync(abc.ABC):
    """Reduce-scatters the buckets' full gradients into each rank's gradient shards; every
    reduce-scatter also carries the ranks' stop ``votes`` (see [Note: stop votes] in ``stop_vote.py``)."""

    def __init__(self, buckets: Sequence[Bucket], votes: Optional[StopVote] = None) -> None:
        self.buckets = list(buckets)
        self.votes = votes

    def _start(self, bucket: Bucket) -> PendingGradientReduction:
        """Start ``bucket``'s reduce-scatter, carrying this rank's stop votes as they are now."""
        if self.votes is None:
            return bucket.start_gradient_reduction()
        return bucket.start_gradient_reduction(self.votes.ballot())

    @abc.abstractmethod
    def finish_backward(self, sync: bool, reads: HostReads) -> None:
        """Called after each backward pass. Once it returns with ``sync=True`` and ``reads`` was
        read, every ``ShardedParam.shard.grad`` holds this rank's chunk of the summed, 1/N-scaled
        gradient (DDP's average). ``sync=False`` marks a micro-batch that will not step
        (accumulation)."""

    @property
    def waiting_peak_bytes(self) -> int:
        """The most bytes of full-size gradients that buckets ready for their reduce-scatter but not
        yet launched held at once in the last backward (see [Note: no waiting in backward]); 0 where
        gradients are reduced after backward (stage 1)."""
        return 0

    def open(self) -> None:
        """Register what ``close`` removed (nothing to register by default)."""

    def close(self) -> None:
        """Remove whatever this policy registered."""


class ReduceAfterBackward(GradientSync):
    """Stage 1: full gradients accumulate in ``param.grad`` as usual; after the backward of a
    micro-batch that steps, the buckets are reduce-scattered one after another (at most
    ``max_in_flight`` at once, bounding the temporary buffers) and the full gradients released.
    Micro-batches that only accumulate communicate nothing."""

    def __init__(self, buckets: Sequence[Bucket], max_in_flight: int = 2, votes: Optional[StopVote] = None) -> None:
        super().__init__(buckets, votes)
        self.max_in_flight = max_in_flight

    def finish_backward(self, sync: bool, reads: HostReads) -> None:
        if not sync:
            return
        started: list[PendingGradientReduction] = []

        def start_each_bucket() -> Iterator[PendingGradientReduction]:
            for bucket in self.buckets:
                started.append(self._start(bucket))
                yield started[-1]

        finish_pipelined(start_each_bucket(), self.max_in_flight)
        hand_out_gradients(started, reads, self.votes)


class ReduceDuringBackward(GradientSync):
    """Stage 2: a bucket's reduce-scatter starts (asynchronously, overlapping the rest of backward)
    as soon as it and every bucket before it have all their gradients, and its full gradients are
    released right then. Buckets still waiting when backward ends (unused parameters) are flushed.
    At most ``max_in_flight`` reduce-scatters run at once, which bounds the communication buffers to
    that many buckets: a ready bucket is launched once the oldest in flight is done, never by
    waiting for it during backward (see [Note: no waiting in backward]).

    Every micro-batch is reduced, also those that only accumulate: that keeps gradient memory
    sharded (the choice ZeRO-2 and FSDP make), at the cost of one reduce-scatter per micro-batch.

    This class registers the one post-accumulate-grad hook per parameter; ``on_grad_accumulated``
    (stage 3's gather schedule) is called from it before the bucket is told.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        max_in_flight: int = 2,
        on_grad_accumulated: Optional[Callable[[ShardedParam], None]] = None,
        votes: Optional[StopVote] = None,
    ) -> None:
        super().__init__(buckets, votes)
        self.max_in_flight = max_in_flight
        self._on_grad_accumulated = on_grad_accumulated
        self._bucket_of: dict[int, Bucket] = {id(p.param): bucket for bucket in self.buckets for p in bucket.params}
        self._handles: list[RemovableHandle] = []
        self._next_to_launch = 0
        self._in_flight: list[PendingGradientReduction] = []  # launched in this backward
        self._unfinished: deque[PendingGradientReduction] = deque()
        self._full_bytes = [bucket.param_bytes for bucket in self.buckets]
        self._waiting_peak = 0  # the most bytes of full gradients ready buckets not yet launched held in this backward
        self._last_waiting_peak = 0
        self.open()

    @property
    def waiting_peak_bytes(self) -> int:
        return self._last_waiting_peak

    def open(self) -> None:
        """Register the hooks (at construction, and again when a module kept sharded after ``fit``
        trains again; a no-op while they are registered)."""
        if not self._handles:
            self._handles = [
                p.param.register_post_accumulate_grad_hook(self._hook_for(p)) for bucket in self.buckets for p in bucket.params
            ]

    def _hook_for(self, param: ShardedParam):
        def on_grad_accumulated(_: object) -> None:
            if self._on_grad_accumulated is not None:
                self._on_grad_accumulated(param)
            bucket = self._bucket_of[id(param.param)]
            was_ready = bucket.is_ready
            became_ready = bucket.mark_ready(param) and not was_ready
            self._launch_ready_buckets()  # this one's bucket, or one that found no room before
            if became_ready:  # only then can the bytes waiting grow
                self._note_waiting()

        return on_grad_accumulated

    def _launch_ready_buckets(self, flush: bool = False) -> None:
        """Launch the ready buckets in bucket order, each once there is room in flight; ``flush``
        (after backward): every bucket left, waiting for room."""
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if not (flush or bucket.is_ready) or not self._make_room(wait=flush):
                return
            self._in_flight.append(self._start(bucket))
            self._unfinished.append(self._in_flight[-1])
            self._next_to_launch += 1

    def _note_waiting(self) -> None:
        """Raise this backward's peak to the full gradients that ready buckets not yet launched hold now."""
        later = range(self._next_to_launch, len(self.buckets))
        waiting = sum(self._full_bytes[i] for i in later if self.buckets[i].is_ready)
        self._waiting_peak = max(self._waiting_peak, waiting)

    def _make_room(self, wait: bool) -> bool:
        """While ``max_in_flight`` are unfinished, finish the oldest if it is done (with ``wait``:
        waiting for it); True once fewer are unfinished. Finishing only for room keeps the buffers
        lent per step the same whatever the peers' timing (the pool allocates in the first step only)."""
        unfinished = self._unfinished
        while len(unfinished) >= self.max_in_flight and (wait or unfinished[0].done()):
            unfinished.popleft().finish()
        return len(unfinished) < self.max_in_flight

    def finish_backward(self, sync: bool, reads: HostReads) -> None:
        self._launch_ready_buckets(flush=True)
        while self._unfinished:
            self._unfinished.popleft().finish()
        hand_out_gradients(self._in_flight, reads, self.votes)
        self._in_flight.clear()
        self._next_to_launch = 0
        self._last_waiting_peak, self._waiting_peak = self._waiting_peak, 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

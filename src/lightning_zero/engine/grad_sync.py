"""When gradients are reduce-scattered into the shards: the one difference between stages 1 and 2.

Both policies issue the buckets' reduce-scatters in one fixed order — the bucket list's — on every
rank, whatever order their gradients arrive in. Collectives are matched by issue order, so this is
what keeps ranks from deadlocking when a parameter is unused on some ranks only.
"""

from __future__ import annotations

import abc
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.bucket import Bucket, PendingGradientReduction, finish_pipelined, hand_out_gradients
from lightning_zero.engine.host_reads import HostReads
from lightning_zero.engine.sharded_param import ShardedParam
from lightning_zero.engine.stop_vote import StopVote


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
    At most ``max_in_flight`` reduce-scatters run at once (launching one more first finishes the
    oldest), which bounds the communication buffers to that many buckets.

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
        self.open()

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
            if self._bucket_of[id(param.param)].mark_ready(param):
                self._launch_ready_buckets()

        return on_grad_accumulated

    def _launch_ready_buckets(self, flush: bool = False) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if not (flush or bucket.is_ready):
                return
            if len(self._unfinished) >= self.max_in_flight:
                self._unfinished.popleft().finish()
            self._in_flight.append(self._start(bucket))
            self._unfinished.append(self._in_flight[-1])
            self._next_to_launch += 1

    def finish_backward(self, sync: bool, reads: HostReads) -> None:
        self._launch_ready_buckets(flush=True)
        while self._unfinished:
            self._unfinished.popleft().finish()
        hand_out_gradients(self._in_flight, reads, self.votes)
        self._in_flight.clear()
        self._next_to_launch = 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

"""When gradients are reduce-scattered into the shards: the one difference between stages 1 and 2.

Both policies issue the buckets' reduce-scatters in one fixed order — the bucket list's — on every
rank, whatever order their gradients arrive in. Collectives are matched by issue order, so this is
what keeps ranks from deadlocking when a parameter is unused on some ranks only.

[Note: no waiting in backward]
A bucket's reduce-scatter is launched as soon as it and every bucket before it are ready, on the
reduce stream (see [Note: reduce stream] in ``reduce_stream.py``); at most ``max_in_flight`` are
unfinished at once, which bounds the communication buffers. Making room finishes the oldest, and
what that costs depends on whether a wait blocks the host:

- **NCCL** (the default, non-blocking waits): finishing makes the reduce stream wait, never the host
  nor the compute stream, so the next bucket is launched at once, whatever the host's lead over the
  device; nothing polls a completion (``Work.is_completed()`` turns true only once the GPU ran the
  kernel, which lags the host by everything queued, so launches gated on it slipped toward the end
  of backward while the ready buckets' full gradients waited: issue 52). The full gradients waiting
  (``memory_report().waiting_gradients``) are then only those of buckets ready before an earlier
  bucket is.
- **gloo, or NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``**: the host would wait, and a rank must not wait
  inside its backward for a collective a peer has not joined. A bucket holding a parameter that one
  rank's backward never reaches (a unit it skips) is launched there only by the flush after its
  backward; a peer that reached it and then waited for it to make room would wait inside its
  backward for the rank that skipped, and at stage 3 that rank's backward needs the all-gathers of
  the units still ahead, which the waiting peer issues only as its own backward reaches them: each
  waits on the other until the timeout. So there a reduction is finished during backward only once
  it is ``done`` (the host runs gloo's collectives, so it sees completion without lag), and a ready
  bucket finding no room keeps its full gradients until a later gradient hook or the flush; what a
  rank skipping units costs its peers is the full gradients of the buckets queued behind the skipped
  one. (``done`` must turn true once a collective has finished: on gloo the reduce-scatter is issued
  as all-reduces whose works say so, ``collectives._reduce_scatter_gloo``; issue 44.)

Waiting for everything starts in ``finish_backward``, after this rank's backward has issued every
all-gather its peers may need (``finish_backward_gathers``); the compute stream waits for the
reduce stream there only. ``tests/test_nccl_semantics.py`` runs the ranks-skip-units cases of
``test_reliability.py`` with gloo's blocking waits, and a run whose collectives report completion
only several gradient hooks late (a host ahead of its device) with NCCL's non-blocking waits.
"""

from __future__ import annotations

import abc
from typing import Callable, Collection, Iterator, Optional, Protocol, Sequence

import torch

from lightning_zero.engine.buckets.bucket import Bucket, PendingGradientReduction, hand_out_gradients
from lightning_zero.engine.buckets.pipelining import finish_pipelined
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.reduce_stream import ReduceStream
from lightning_zero.engine.comm.stop_vote import StopVote
from lightning_zero.engine.shards.sharded_param import ShardedParam


MAX_IN_FLIGHT = 2
"""Reductions unfinished at once (and, where bounded, buckets the reduce stream may lag behind):
enough to overlap one with the next one's copy-in."""


class GradientListener(Protocol):
    """What hears of each parameter's accumulated gradient in backward (stage 3's gather schedule,
    for units whose inputs need no gradient: their last parameter gradient ends their backward), and
    tells of each unit's end of backward (see [Note: readiness per unit] in ``unit_readiness.py``)."""

    awaiting: Collection
    """Not empty while some unit waits on its parameters' gradients: only then is it called (an
    attribute, so the usual backward, where none waits, makes no call per parameter for it)."""

    root_unit: int
    """The index of the unit whose buckets no unit end launches (the root's: gathered for the step)."""

    unit_backward_ended: Optional[Callable[[int], None]]
    """Set by the gradient sync: called with a unit's index once its backward is over."""

    def grad_accumulated(self, param: ShardedParam) -> None: ...


class GradientSync(abc.ABC):
    """Reduce-scatters the buckets' full gradients into each rank's gradient shards; every
    reduce-scatter also carries the ranks' stop ``votes`` (see [Note: stop votes] in ``stop_vote.py``)."""

    def __init__(self, buckets: Sequence[Bucket], votes: Optional[StopVote] = None) -> None:
        self.buckets = list(buckets)
        self.votes = votes
        self.stream = ReduceStream(self.buckets[0].device if self.buckets else torch.device("cpu"))
        """Where the reductions run (see [Note: reduce stream] in ``reduce_stream.py``)."""

    finish_early = False
    """Finish each reduction as soon as that waits for nothing (NCCL: at once, on the reduce stream;
    where waits block the host: once it is done), not only to make room: set while offloaded
    buckets step during backward, which starts as a bucket's row is copied to the host, in ``finish``
    (see [Note: the host step during backward] in ``step_ahead.py``)."""

    def _start(self, bucket: Bucket, bounded: bool = False) -> PendingGradientReduction:
        """Start ``bucket``'s reduce-scatter, carrying this rank's stop votes as they are now;
        ``bounded``: its gradients count against the reduce stream's lag (see "its lag" in [Note:
        reduce stream])."""
        ballot = self.votes.ballot() if self.votes is not None else (False,) * StopVote.WIDTH
        return bucket.start_gradient_reduction(ballot, self.stream, bounded)

    def _hand_out(self, started: Sequence[PendingGradientReduction], reads: HostReads) -> None:
        """After every reduction in ``started`` was finished: the compute stream waits for the
        reduce stream (the one place it does), then the reduced chunks are handed out."""
        self.stream.join()
        hand_out_gradients(started, reads, self.votes)

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

    @property
    def unpacked_peak_bytes(self) -> int:
        """The most bytes of full-size gradients of launched buckets whose copy-in the reduce stream
        had not run yet, seen at a launch in the last backward (the reduce stream's lag, see [Note:
        reduce stream]); 0 where work is synchronous or gradients are reduced after backward."""
        return 0

    def late_gradients_agreed(self) -> None:
        """The ranks agreed a gradient came late (stage 3 only, see [Note: readiness per unit])."""

    def open(self) -> None:
        """Register what ``close`` removed (nothing to register by default)."""

    def close(self) -> None:
        """Remove whatever this policy registered."""


class ReduceAfterBackward(GradientSync):
    """Stage 1: full gradients accumulate in ``param.grad`` as usual; after the backward of a
    micro-batch that steps, the buckets are reduce-scattered one after another (at most
    ``max_in_flight`` at once, bounding the temporary buffers) and the full gradients released.
    Micro-batches that only accumulate communicate nothing."""

    def __init__(self, buckets: Sequence[Bucket], max_in_flight: int = MAX_IN_FLIGHT, votes: Optional[StopVote] = None) -> None:
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
        self._hand_out(started, reads)

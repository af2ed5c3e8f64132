"""What a bucket's collectives leave to finish: a gradient reduction in flight, a parameter gather in
flight, and handing the reduced chunks out once the used flags are read (see ``bucket.py``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.reduce_stream import ReduceStream
from lightning_zero.engine.comm.stop_vote import StopVote

NO_STREAM = ReduceStream(torch.device("cpu"))
"""Where a reduction runs without a stream of its own (the CPU, or no ``ReduceStream`` given)."""


@dataclass
class PendingGradientReduction:
    bucket: Any  # the Bucket (bucket.py imports this module)
    work: collectives.PendingCollective
    """The reduce-scatter, or with qgZ the two all-to-alls (``quantized_reduction.QuantizedReduction``),
    which fill ``received`` as the reduce-scatter would."""
    received: Optional[Tensor]
    """(S + F,): this rank's reduced chunks, used flags and stop votes; None where nothing is left to hand
    out (world size 1). Not from the pool: its chunks become the gradient shards as they are."""
    lent: list[Tensor] = field(default_factory=list)
    """Pool buffers the collective reads, given back once it is finished."""
    stream: Optional[ReduceStream] = None
    """Where the reduction runs: its waits and what follows them are issued there (see [Note:
    reduce stream] in ``reduce_stream.py``)."""
    _flags: Optional[Tensor] = None
    _across_replicas: Optional[collectives.PendingCollective] = None

    def done(self) -> bool:
        """Whether ``finish`` would return without the host waiting for a peer; never blocks. Asked
        only where waits block the host (gloo, NCCL's blocking wait): there the host is what runs
        the collectives, so it sees a completion as it happens. With hybrid sharding and such waits,
        a finished reduce-scatter starts the all-reduce across the replicas here, and with qgZ a
        finished all-to-all within the node starts the one across nodes (``QuantizedReduction.done``),
        so call it on the reductions in the order they were started (as ``finish``)."""
        if not self.work.done():
            return False
        across = self.start_across_replicas()
        return across is None or across.done()

    def finish(self) -> None:
        """Make what runs next on the reduction's stream wait for the collectives (on gloo: the
        host waits), then give the buffers back; ``hand_out_gradients`` then gives out the chunks.
        An offloaded bucket's row starts its copy to the host here, during backward."""
        stream = self.stream or NO_STREAM
        if stream.stream is None:  # no stream to finish on: no context to enter (one per reduction)
            self._finish_here()
            return
        with stream.finishing():
            self._finish_here()

    def _finish_here(self) -> None:
        """``finish`` on the current stream."""
        self.work.wait()
        if self.bucket.replicate_group is not None:
            across = self.start_across_replicas()
            if across is not None:
                across.wait()
        copy = None
        host = self.bucket.host
        if host is not None and self.received is not None:
            self._flags = self.received[self.bucket.shard_numel :].clone()  # the device row goes back to the pool
            self.received, copy = host.receive(self.received, self.bucket.pool)
        for buffer in self.lent:  # given back here, not through a helper: once per reduction
            self.bucket.pool.give_back(buffer, copy)
        self.lent.clear()

    def start_across_replicas(self) -> Optional[collectives.PendingCollective]:
        """Hybrid sharding: the all-reduce of the reduced chunks over the other shard groups' sums,
        issued (once) on the reduction's stream after the reduce-scatter: on NCCL ordered by the
        stream; on gloo after the host waited for it (None without replicas)."""
        if self.bucket.replicate_group is None or self.received is None:
            return None
        if self._across_replicas is None:
            with (self.stream or NO_STREAM).finishing():
                self.work.wait()
                self._across_replicas = collectives.start_all_reduce(self.received, self.bucket.replicate_group)
        return self._across_replicas

    @property
    def flags(self) -> Tensor:
        """(F,): per parameter, how many ranks produced a gradient (see [Note: used flags]), then the
        summed stop votes; on the device, also for an offloaded bucket, so reading them waits for no copy."""
        return self._flags if self._flags is not None else self.received[self.bucket.shard_numel :]

    def hand_out(self, votes: Optional[StopVote], flags: Sequence[float]) -> None:
        """With the flags read on the host: give out the gradient chunks, count the stop votes."""
        k = len(self.bucket.params)
        self.bucket.accept_gradients(self.received, flags[:k])
        if votes is not None:
            votes.count(flags[k:])


def hand_out_gradients(
    reductions: Sequence[PendingGradientReduction], reads: HostReads, votes: Optional[StopVote] = None
) -> None:
    """At ``reads``' next read, give every parameter of the finished ``reductions`` its reduced
    gradient chunk (the used flags decide which; see [Note: deferred verdicts] in ``host_reads.py``)
    and count the stop votes they carried into ``votes`` (one rank: its own ballot)."""
    for reduction in reductions:
        if reduction.received is None:
            reduction.bucket.accept_gradients(None, ())
            if votes is not None:
                votes.count(votes.ballot())
        else:
            reads.add(reduction.flags, functools.partial(reduction.hand_out, votes))


@dataclass
class PendingParamGather:
    bucket: Any  # the Bucket (bucket.py imports this module)
    work: collectives.PendingCollective
    gathered: Optional[Tensor]
    """(N * (S [+ 1]),): every rank's chunks (qwZ: (N * row_bytes,) uint8); None where nothing is
    left to copy (world size 1)."""
    tags: Optional[Any] = None
    lent: list[Tensor] = field(default_factory=list)
    """Pool buffers the collective reads or fills, given back once their contents are copied out."""
    pool: Optional[BufferPool] = None
    """Where ``lent`` came from (default: the bucket's pool)."""
    quantized: Optional[Any] = None
    """qwZ: the ``QuantizedGather`` whose rows ``gathered`` holds (see [Note: quantized gather rows]
    in ``quantized_gather.py``); None: plain rows."""

    def finish(self, secondary: Optional[Any] = None) -> None:
        """Wait for the all-gather and copy every rank's chunk into the full parameters; hpZ: a
        training forward's gather also hands its rows to ``secondary`` (the bucket's
        ``BucketSecondary``), which keeps this rank's share for backward."""
        self.work.wait()
        self.bucket._finish_param_gather(self.gathered, self.tags, self.quantized, secondary)
        pool = self.pool if self.pool is not None else self.bucket.pool
        for buffer in self.lent:  # given back here, not through a helper: once per gather
            pool.give_back(buffer)
        self.lent.clear()

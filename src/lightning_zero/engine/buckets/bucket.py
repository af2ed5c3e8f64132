"""Buckets: parameters that communicate together, in one collective per direction.

See [Note: chunk layout] in ``partition.py`` for the buffer layout.

[Note: used flags]
A gradient reduce-scatter carries, after the S gradient columns, one extra column per parameter:
1 where this rank produced a gradient for it in this backward, 0 where it did not (an unused
branch). Summed by the same collective, every rank learns which parameters got a gradient on *some*
rank: those get a gradient shard (zeros from the ranks that had none, as DDP does); those unused
everywhere keep ``grad=None`` so the optimizer skips them, again as DDP does. This costs no extra
collective and k elements per rank. After the k used flags come ``StopVote.WIDTH`` columns of stop
votes, summed the same way (see [Note: stop votes] in ``stop_vote.py``). With qgZ the gradient
columns travel quantized and these travel beside them as exact fp32 (see [Note: quantized gradient
reduction] in ``quantized_reduction.py``).
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.buckets.quantized_gather import QuantizedGather
from lightning_zero.engine.buckets.pending import (  # noqa: F401 (re-exported: the pending collectives are part of a bucket's API)
    NO_STREAM,
    PendingGradientReduction,
    PendingParamGather,
    hand_out_gradients,
)
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.comm.quantized_reduction import QuantizedGradients
from lightning_zero.engine.comm.reduce_stream import ReduceStream
from lightning_zero.engine.comm.stop_vote import StopVote
from lightning_zero.engine.offload.host_chunks import HostChunks
from lightning_zero.engine.offload.scratch_files import ScratchDirectory
from lightning_zero.engine.shards.full_targets import FullTargets
from lightning_zero.engine.shards.gathered_storage import GatheredStorage
from lightning_zero.engine.shards.partition import interleaved_sizes, pack_rows, unpack_rows
from lightning_zero.engine.shards.sharded_param import ShardedParam, accumulate_grads


class GatherTags(Protocol):
    """What a stage-3 all-gather carries besides the chunks: the tag of what this rank gathers,
    checked against every rank's once gathered (``parameters.unit.UnitTags``, see [Note: unit tags]
    in ``unit.py``)."""

    tag: int

    def check(self, gathered: Tensor) -> None:
        """``gathered`` (N,): the tag every rank sent with this gather, on the device."""
        ...


class KeepsRows(Protocol):
    """hpZ: what keeps this rank's share of a training forward's gathered rows for backward
    (``parameters.secondary_shards.BucketSecondary``)."""

    def keep(self, rows: Tensor) -> None:
        """``rows`` (N, S [+ columns]): every rank's chunks as gathered (dequantized with qwZ)."""
        ...


class ReductionState(enum.Enum):
    """Lifecycle of a bucket's gradients within one backward pass."""

    COLLECTING = "collecting"  # waiting for its parameters' gradients
    REDUCING = "reducing"  # reduce-scatter issued, not yet finished


class Bucket:
    """A group of same-dtype parameters, reduced and gathered in one collective per direction.

    ``group`` carries the gradient reduce-scatters, ``gather_group`` (default: ``group``) the
    parameter all-gathers; ``pool`` lends the communication buffers (see ``buffers.py``). With
    ``copies``, offloaded parameters keep their chunks in the bucket's ``host`` buffers (see
    [Note: offloaded bucket] in ``host_chunks.py``), and with ``param_files`` those chunks live in a
    file named ``name`` there between uses (see [Note: parameters on disk] in ``masters_on_disk.py``).
    ``weight_format`` (qwZ, stage 3): the block format a step's gathers may be sent in
    (``start_param_gather(quantize=True)``, see ``quantized_gather.py``).
    With ``quantized_gradients`` (qgZ), the gradients are reduced within then across nodes in
    quantized blocks instead of by the reduce-scatter.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[ShardedParam],
        group: collectives.ProcessGroup,
        pool: Optional[BufferPool] = None,
        gather_group: collectives.ProcessGroup = None,
        copies: Optional[CopyStream] = None,
        replicate_group: collectives.ProcessGroup = None,
        param_files: Optional[ScratchDirectory] = None,
        name: str = "bucket",
        weight_format: Optional[str] = None,
        quantized_gradients: Optional[QuantizedGradients] = None,
    ) -> None:
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        self.group = group
        self.gather_group = gather_group if gather_group is not None else group
        self.pool = pool if pool is not None else BufferPool(capacity_bytes=0, slots=0)
        self.world_size = collectives.world_size(group)
        self._gather_rank = collectives.rank(self.gather_group)  # the row of an all-gather this rank sends
        # one rank, its shortcuts taken: asked once, as the groups' facts are read once (see ``collectives.resolved``)
        self._reduces_alone = collectives.takes_one_rank_shortcuts(self.group)
        self._gathers_alone = collectives.takes_one_rank_shortcuts(self.gather_group)
        self.replicate_group = replicate_group
        """Hybrid sharding: the ranks holding the same chunks in the other shard groups, across
        which the reduced chunks are all-reduced (None: every rank is in ``group``)."""
        self.replicas = collectives.world_size(replicate_group) if replicate_group is not None else 1
        self.quantized_gradients = quantized_gradients
        """qgZ: the gradients are reduced by two quantized all-to-alls over the node layout's groups
        instead of the reduce-scatter over ``group`` (see [Note: quantized gradient reduction] in
        ``quantized_reduction.py``); None: the reduce-scatter."""
        self.dtype = params[0].param.dtype
        self.device = params[0].param.device
        self._widths = [p.padded_chunk_numel for p in self.params]  # each parameter's block, c_i
        self.shard_numel = sum(self._widths)  # S: elements per rank, padding included
        self._row_sizes = interleaved_sizes([p.owned_numel for p in self.params], self._widths)
        self.flag_count = len(self.params) + StopVote.WIDTH
        """F: the columns after the gradient chunks in a reduce-scatter: used flags, then stop votes."""
        self.state = ReductionState.COLLECTING
        self._ready: set[int] = set()
        self._every_param = frozenset(id(p) for p in self.params)
        self.ready = False
        """Every parameter's gradient for this backward has been accumulated (or will contribute
        zeros): a plain attribute, read per bucket where gradients arrive."""
        self.gathered: Optional[GatheredStorage] = None
        """Stage 3: the parameters' full values, gathered into and freed (see [Note: stage-3 storage]
        in ``gathered_storage.py``)."""
        if not self.params[0].keeps_full:
            self.gathered = GatheredStorage(
                [p.layout for p in self.params], [p.shape for p in self.params], self.dtype, self.device
            )
        self.full_targets: Optional[FullTargets] = FullTargets(self.params) if self.params[0].keeps_full else None
        """Stages 1-2: the full parameters, checked for assigned ``.data`` and written back into as one."""
        self.quantized: Optional[QuantizedGather] = None
        """qwZ: this bucket's quantized gather (stage 3 with ``weight_format``), else None."""
        if weight_format is not None and self.gathered is not None:
            self.quantized = QuantizedGather(
                weight_format, self.shard_numel, collectives.world_size(self.gather_group), self._gather_rank,
                self.gather_group, self.dtype, self.device, self.pool,
            )  # fmt: skip
        self.host: Optional[HostChunks] = None
        if copies is not None and self.params[0].offloaded:
            self.host = HostChunks(
                self.params, self._row_sizes, self.flag_count, copies, trainable=self.params[0].param.requires_grad,
                files=param_files, name=name,
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"Bucket({self.index}, params={len(self.params)}, shard_numel={self.shard_numel}, dtype={self.dtype})"

    @property
    def param_bytes(self) -> int:
        return sum(p.layout.numel for p in self.params) * self.params[0].param.element_size()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this bucket's largest communication buffer: the reduce-scatter's input
        (N, S + F), which is also at least the all-gather's output (N, S + 1); offloaded half
        weights also cast a row (S + F) to fp32 on the device."""
        row = self.shard_numel + self.flag_count
        staged = row * self.params[0].master_dtype.itemsize if self.host is not None else 0
        return max(self.world_size * row * self.params[0].param.element_size(), staged)

    # ---- gradients -------------------------------------------------------------------------
    def mark_ready(self, param: ShardedParam) -> bool:
        """Record that ``param``'s gradient is accumulated; True when that made the bucket ready
        (every parameter's is), False before and after."""
        if self.state is not ReductionState.COLLECTING:
            raise RuntimeError(
                f"Parameter {param.name!r} received a gradient after its bucket was already reduced in"
                " this backward pass. lightning-zero reduces each gradient once per backward: a"
                " parameter may not receive gradients from two separate `backward()` calls between"
                " optimizer synchronisations (use one backward over the summed losses)."
            )
        if self.ready:
            return False
        self._ready.add(id(param))
        self.ready = len(self._ready) == len(self.params)
        return self.ready

    def mark_all_ready(self) -> bool:
        """Stage 3, a unit's backward over (see [Note: readiness per unit] in ``unit_readiness.py``):
        every parameter's gradient is in, or will contribute zeros; True if that made it ready."""
        if self.ready:
            return False
        self._ready.update(self._every_param)
        self.ready = True
        return True

    def start_gradient_reduction(
        self, ballot: Sequence[bool] = (False,) * StopVote.WIDTH, stream: Optional[ReduceStream] = None, bounded: bool = False
    ) -> "PendingGradientReduction":
        """Copy the local gradients in (multiplied by 1/N, N all data-parallel ranks, as DDP does),
        free them, and start the reduce-scatter (with hybrid sharding, then the all-reduce of the
        chunks across the replicas; with qgZ, the two quantized all-to-alls instead of the
        reduce-scatter). Parameters without a gradient contribute zeros and a 0 used-flag;
        ``ballot`` is this rank's stop votes (see [Note: stop votes] in ``stop_vote.py``). With a CUDA
        ``stream``, the copy-in and the collectives run there, ordered after the compute stream's
        work (see [Note: reduce stream] in ``reduce_stream.py``); the host never waits. ``bounded``:
        its gradients count against the reduce stream's lag (``ReduceStream.launching``)."""
        if self.state is not ReductionState.COLLECTING:
            raise RuntimeError(f"{self} is already being reduced")
        alone = self._reduces_alone
        if alone and self.host is None and self.replicate_group is None:
            return self._take_local_gradients()
        stream = stream if stream is not None else NO_STREAM
        s, f = self.shard_numel, self.flag_count
        received = None
        if self.host is None:
            # its chunks become the gradient shards as they are, read on the compute stream after
            # ``finish_backward`` joined the reduce stream: allocated there, so never lent
            received = torch.empty(s + f, dtype=self.dtype, device=self.device)
        if stream.stream is None:  # no stream to launch on: no context to enter (one per reduction)
            return self._launch_reduction(ballot, stream, received, alone)
        with stream.launching(bounded):
            return self._launch_reduction(ballot, stream, received, alone)

    def _launch_reduction(
        self, ballot: Sequence[bool], stream: ReduceStream, received: Optional[Tensor], alone: bool
    ) -> "PendingGradientReduction":
        """``start_gradient_reduction``'s copy-in and collectives, on the current stream."""
        n, s, f = self.world_size, self.shard_numel, self.flag_count
        if alone and received is not None:
            # one-rank shard groups (hybrid): the packed row is the reduced row
            send = received.view(1, s + f)
        else:
            send = self.pool.take(n * (s + f), self.dtype, self.device).view(n, s + f)  # (N, S + F)
        flags = torch.ones(n, f, dtype=self.dtype, device=self.device)  # (N, F)
        flats, local = [], _take_local_grads(self.params)  # the full-size gradients are released once copied in
        for i, (p, grad) in enumerate(zip(self.params, local)):
            if grad is not None:
                flats.append(grad.view(-1))
            else:
                flats.append(torch.zeros(p.layout.numel, dtype=self.dtype, device=self.device))
                flags[:, i] = 0
        if stream.stream is not None:  # the reduce stream reads them (none: read here, at once)
            stream.keep_alive([grad for grad in local if grad is not None])
        _mark_ballot(flags[:, len(self.params) :], ballot)
        pack_rows([*flats, flags.view(-1)], send, scale=1.0 / (n * self.replicas))  # see [Note: batched copies]
        del flats
        self.state = ReductionState.REDUCING
        if alone:  # the packed row is the reduced one: offloaded, it is lent until copied to the host
            lent = [send] if self.host is not None else []
            pending = PendingGradientReduction(self, collectives.PendingCollective(), send.view(-1), lent=lent, stream=stream)
        else:
            lent = []
            if self.host is not None:  # copied to the host once reduced, so lent for the collective only
                received = self.pool.take(s + f, self.dtype, self.device)
                lent.append(received)
            if self.quantized_gradients is not None:  # qgZ: the packed rows go back to the pool once quantized
                give_back = functools.partial(self.pool.give_back, send)
                work = self.quantized_gradients.start(send[:, :s], send[0, s:], received, self.pool, stream, give_back)
            else:
                lent.append(send)
                work = collectives.start_reduce_scatter(received, send.view(-1), self.group)
            pending = PendingGradientReduction(self, work, received, lent=lent, stream=stream)
        if self.replicate_group is not None and self._chains_replicas:
            pending.start_across_replicas()
        return pending

    @functools.cached_property
    def _chains_replicas(self) -> bool:
        """Whether the all-reduce across the replicas is issued right behind the reduce-scatter
        (ordered by the stream: no wait blocks the host) rather than once the reduce-scatter is
        done (where waiting for it would block the host, see [Note: reduce stream])."""
        return not collectives.waits_block_host(self.group, self.device)

    def _take_local_gradients(self) -> "PendingGradientReduction":
        """World size 1: the reduced gradient is the local one and the chunk is the whole
        parameter, so each gradient becomes its shard's as it is (a view where dtype and device
        agree), with no buffer, copy or collective; nothing is left to hand out."""
        accumulate_grads(self.params, [g.view(-1) if g is not None else None for g in _take_local_grads(self.params)])
        return PendingGradientReduction(self, collectives.PendingCollective(), received=None)

    def accept_gradients(self, received: Optional[Tensor], used_anywhere: Sequence[float]) -> None:
        """Hand each parameter its chunk of the reduced gradients in ``received`` (S + F,), skipping
        those no rank used (see [Note: used flags]); ``used_anywhere`` is the used flags read on the host.
        ``received`` None: the gradients were taken locally already (world size 1)."""
        if self.host is not None:
            self.host.accept(received, used_anywhere)
        elif received is not None:
            pieces = torch.split_with_sizes(received, [*self._row_sizes, self.flag_count])
            accumulate_grads(self.params, [pieces[2 * i] if used_anywhere[i] > 0 else None for i in range(len(self.params))])
        self._ready.clear()
        self.ready = False
        self.state = ReductionState.COLLECTING

    # ---- parameters ------------------------------------------------------------------------
    def start_param_gather(self, tags: Optional["GatherTags"] = None, quantize: bool = False) -> "PendingParamGather":
        """All-gather every rank's updated chunks (cast to the parameter dtype).

        With ``tags`` (stage 3), each rank appends the tag of what it gathers to its row, and
        finishing hands every rank's tag to ``tags`` to check (see [Note: unit tags] in ``unit.py``).
        ``quantize``: a step's gather of a bucket with a weight format (qwZ) is sent as quantized
        blocks (see [Note: quantized gather rows] in ``quantized_gather.py``); the chunks stay as they are.
        """
        host = self.host
        if host is not None and host.unsettled is not None and host.before_device_read is not None:
            host.before_device_read()  # its device chunks as before a step taken ahead of its verdict
        if self._gathers_alone:
            tags = None  # one rank cannot disagree with itself
            if self.params[0].keeps_full:
                return self._write_back_locally()
        if quantize and self.quantized is not None:
            return self.quantized.start(self, self._write_send_row, tags.tag if tags is not None else None, tags)
        n, s = self.world_size, self.shard_numel
        row = s + (tags is not None)
        gathered = self.pool.take(n * row, self.dtype, self.device)  # (N * (S [+ 1]),)
        # in place, as FSDP2 gathers: this rank's row of the output is the input, so the send row
        # costs no buffer of its own (on the host: no fresh pages every gather); padding is never read
        send = gathered[self._gather_rank * row : (self._gather_rank + 1) * row]  # (S [+ 1],): one slice op
        # `_write_send_row`, inline: a Python call less per gather (see [Note: host work counts] in host_work.py)
        if self.host is not None and not self.host.device_chunks:  # the send row comes from the host chunks
            self.host.copy_master_to(send[:s])
        else:
            pieces = torch.split_with_sizes(send, [*self._row_sizes, row - s])
            # the send sources are detached from the shards (the optimizer's parameters), so this
            # records no autograd history without a `torch.no_grad()` (5 Python calls a gather)
            torch._foreach_copy_(list(pieces[0 : 2 * len(self.params) : 2]), list(map(_SEND_SOURCE, self.params)))
        if tags is not None:
            send[s] = tags.tag
        work = collectives.start_all_gather(gathered, send, self.gather_group)
        return PendingParamGather(self, work, gathered, tags, lent=[gathered])

    def _write_send_row(self, send: Tensor) -> None:
        """Copy this rank's chunks into ``send`` (S,), cast to the parameter dtype, as
        ``start_param_gather`` does; the padding between them is left as it is (qwZ's row)."""
        if self.host is not None and not self.host.device_chunks:  # the send row comes from the host chunks
            self.host.copy_master_to(send)
        else:
            pieces = torch.split_with_sizes(send, self._row_sizes)
            torch._foreach_copy_(list(pieces[0 : 2 * len(self.params) : 2]), list(map(_SEND_SOURCE, self.params)))

    def start_write_back(self, pool: BufferPool) -> "PendingParamGather":
        """Stages 1-2 with offload, on the host step's thread as soon as it stepped this bucket:
        ``start_param_gather`` of the master chunks as they are (the step's own thread reads them:
        nothing to settle), its buffer from ``pool`` (the training thread's pool serves backward's
        reductions meanwhile). See [Note: copies back per bucket] in ``copies_back.py``."""
        assert self.host is not None and self.params[0].keeps_full
        if self._gathers_alone:
            return self._write_back_locally()
        n, s = self.world_size, self.shard_numel
        gathered = pool.take(n * s, self.dtype, self.device)
        send = gathered[self._gather_rank * s : (self._gather_rank + 1) * s]
        send.copy_(self.host.copies.to_device(self.host.master))
        work = collectives.start_all_gather(gathered, send, self.gather_group)
        return PendingParamGather(self, work, gathered, None, lent=[gathered], pool=pool)

    def _write_back_locally(self) -> "PendingParamGather":
        """World size 1, full parameters kept (stages 1-2): the chunk is the whole parameter, so the
        only work is copying the shards that do not alias their parameter (fp32 masters of half
        parameters, offloaded chunks) back into it; nothing is left to finish."""
        with torch.no_grad():
            if self.host is not None:  # one copy of the bucket to the device, then into the parameters
                row = self.host.copies.to_device(self.host.master)
                flats, flat_rows = self.full_targets.targets()
                unpack_rows(row.view(1, -1), flats, self._widths, flat_rows)
            else:
                self.full_targets.copy_whole_chunks()
        return PendingParamGather(self, collectives.PendingCollective(), gathered=None)

    def _finish_param_gather(
        self, gathered: Optional[Tensor], tags: Optional["GatherTags"], quantized: Optional[QuantizedGather] = None,
        secondary: Optional["KeepsRows"] = None,
    ) -> None:  # fmt: skip
        if gathered is None:
            return
        if quantized is not None:
            rows, sent_tags = quantized.rows(gathered)  # (N, S) dequantized, (N,)
        else:
            rows = gathered.view(self.world_size, -1)  # (N, S [+ 1])
            sent_tags = rows[:, self.shard_numel] if tags is not None else None
        if tags is not None:
            tags.check(sent_tags)
        if secondary is not None:  # hpZ: this rank's share, for backward's gather (with qwZ: as dequantized)
            secondary.keep(rows)
        # the targets are plain tensors (stage 3's storage views) or detached views of the
        # parameters (stages 1-2): no autograd history, without a `torch.no_grad()`
        if self.gathered is not None:
            self.gathered.fill(rows)
        else:
            flats, flat_rows = self.full_targets.targets()
            unpack_rows(rows, flats, self._widths, flat_rows)


_SEND_SOURCE = operator.attrgetter("send_source")
"""Each parameter's send row source, read at C level (no comprehension frame per gather)."""


def _mark_ballot(columns: Tensor, ballot: Sequence[bool]) -> None:
    """Fill the stop-vote columns (N, StopVote.WIDTH) of a reduce-scatter's flags with ``ballot``
    (one kernel when nothing is requested, the usual case)."""
    columns.zero_()
    for column, requested in enumerate(ballot):
        if requested:
            columns[:, column] = 1


def _take_local_grads(params: Sequence[ShardedParam]) -> list[Optional[Tensor]]:
    """Each parameter's gradient of this backward to reduce (None where it has none), taken out of
    ``param.grad``. A shard switched off by ``LightningModule.toggle_optimizer`` (which sees the
    shards) contributes none, as its parameter would not under DDP. Stage-3 parameters are at rest
    here: their ``.grad`` is read and cleared without a ``__torch_function__`` call each."""
    with torch._C.DisableTorchFunctionSubclass():
        grads = [p.param.grad if p.shard.requires_grad else None for p in params]
        for p in params:
            p.param.grad = None
    return grads

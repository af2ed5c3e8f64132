"""Buckets: parameters that communicate together, in one collective per direction.

See [Note: chunk layout] in ``partition.py`` for the buffer layout.

[Note: used flags]
A gradient reduce-scatter carries, after the S gradient columns, one extra column per parameter:
1 where this rank produced a gradient for it in this backward, 0 where it did not (an unused
branch). Summed by the same collective, every rank learns which parameters got a gradient on *some*
rank: those get a gradient shard (zeros from the ranks that had none, as DDP does); those unused
everywhere keep ``grad=None`` so the optimizer skips them, again as DDP does. This costs no extra
collective and k elements per rank.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_zero.engine import collectives
from lightning_zero.engine.partition import copy_flat_into_rows, copy_rows_into_flat
from lightning_zero.engine.sharded_param import ShardedParam


class ReductionState(enum.Enum):
    """Lifecycle of a bucket's gradients within one backward pass."""

    COLLECTING = "collecting"  # waiting for its parameters' gradients
    REDUCING = "reducing"  # reduce-scatter issued, not yet finished


class Bucket:
    """A group of same-dtype parameters of one optimizer, reduced and gathered in one collective."""

    def __init__(self, index: int, params: Sequence[ShardedParam], group: collectives.ProcessGroup) -> None:
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        self.group = group
        self.world_size = collectives.world_size(group)
        self.dtype = params[0].param.dtype
        self.device = params[0].param.device
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.padded_chunk_numel
        self.shard_numel = offset  # S: elements per rank, padding included
        self.state = ReductionState.COLLECTING
        self._ready: set[int] = set()

    def __repr__(self) -> str:
        return f"Bucket({self.index}, params={len(self.params)}, shard_numel={self.shard_numel}, dtype={self.dtype})"

    def _columns(self, buffer: Tensor, i: int) -> Tensor:
        """Parameter i's (N, c_i) block of an (N, S...) buffer."""
        start = self.offsets[i]
        return buffer[:, start : start + self.params[i].padded_chunk_numel]

    # ---- gradients -------------------------------------------------------------------------
    def mark_ready(self, param: ShardedParam) -> bool:
        """Record that ``param``'s gradient is accumulated; True once every parameter is."""
        if self.state is not ReductionState.COLLECTING:
            raise RuntimeError(
                f"Parameter {param.name!r} received a gradient after its bucket was already reduced in"
                " this backward pass. lightning-zero reduces each gradient once per backward: a"
                " parameter may not receive gradients from two separate `backward()` calls between"
                " optimizer synchronisations (use one backward over the summed losses)."
            )
        self._ready.add(id(param))
        return self.is_ready

    @property
    def is_ready(self) -> bool:
        """Every parameter's gradient for this backward has been accumulated."""
        return len(self._ready) == len(self.params)

    def start_gradient_reduction(self) -> "PendingGradientReduction":
        """Copy the local gradients in (multiplied by 1/N, as DDP does), free them, and start the
        reduce-scatter. Parameters without a gradient contribute zeros and a 0 used-flag."""
        if self.state is not ReductionState.COLLECTING:
            raise RuntimeError(f"{self} is already being reduced")
        n, s, k = self.world_size, self.shard_numel, len(self.params)
        grad_dtype = self.dtype
        send = torch.empty(n, s + k, dtype=grad_dtype, device=self.device)  # (N, S + k)
        for i, p in enumerate(self.params):
            grad = p.param.grad
            block = self._columns(send, i)
            # a shard switched off by `LightningModule.toggle_optimizer` (which sees the shards)
            # gets no gradient, as its parameter would not under DDP
            if grad is None or not p.shard.requires_grad:
                block.zero_()
                send[:, s + i].zero_()
            else:
                copy_flat_into_rows(grad.detach().view(-1), block, scale=1.0 / n)
                send[:, s + i].fill_(1)
            p.param.grad = None  # the full-size gradient is released here
        received = torch.empty(s + k, dtype=grad_dtype, device=self.device)  # (S + k,)
        work = collectives.start_reduce_scatter(received, send.view(-1), self.group)
        self.state = ReductionState.REDUCING
        return PendingGradientReduction(self, work, received)

    def _finish_gradient_reduction(self, received: Tensor) -> None:
        s = self.shard_numel
        used_anywhere = received[s:].tolist()  # one device sync per bucket
        for i, p in enumerate(self.params):
            if used_anywhere[i] > 0:
                start = self.offsets[i]
                p.accumulate_grad(received[start : start + p.owned_numel])
        self._ready.clear()
        self.state = ReductionState.COLLECTING

    # ---- parameters ------------------------------------------------------------------------
    def start_param_gather(self, tag: Optional[int] = None) -> "PendingParamGather":
        """All-gather every rank's updated chunks (cast to the parameter dtype).

        With a ``tag`` (a small integer naming what is gathered), each rank appends it to its row,
        and finishing checks that every rank gathered the same thing (see ``_check_tags``).
        """
        n, s = self.world_size, self.shard_numel
        row = s + (tag is not None)
        send = torch.zeros(row, dtype=self.dtype, device=self.device)  # (S [+ 1],)
        for p, start in zip(self.params, self.offsets):
            p.write_chunk_to(send[start : start + p.owned_numel])
        if tag is not None:
            send[s] = tag
        gathered = torch.empty(n * row, dtype=self.dtype, device=self.device)  # (N * (S [+ 1]),)
        work = collectives.start_all_gather(gathered, send, self.group)
        return PendingParamGather(self, work, gathered, tag)

    def _finish_param_gather(self, gathered: Tensor, tag: Optional[int]) -> None:
        rows = gathered.view(self.world_size, -1)  # (N, S [+ 1])
        if tag is not None:
            _check_tags(rows[:, self.shard_numel].tolist(), tag)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                copy_rows_into_flat(self._columns(rows, i), p.gather_target())


def _check_tags(tags: list[float], expected: int) -> None:
    if any(t != expected for t in tags):
        raise RuntimeError(
            "The ranks gathered different ZeRO-3 units at the same point (unit tags by rank:"
            f" {[int(t) for t in tags]}): the forward took different modules, or a different number"
            " of them, on different ranks. Every rank must run the same modules in the same order;"
            " make data-dependent branches agree across ranks (e.g. decide them on rank 0 and"
            " broadcast), or run such modules outside the sharded units."
        )


@dataclass
class PendingGradientReduction:
    bucket: Bucket
    work: collectives.PendingCollective
    received: Tensor

    def finish(self) -> None:
        """Wait for the reduce-scatter and accumulate this rank's chunks into the shard gradients."""
        self.work.wait()
        self.bucket._finish_gradient_reduction(self.received)


@dataclass
class PendingParamGather:
    bucket: Bucket
    work: collectives.PendingCollective
    gathered: Tensor
    tag: Optional[int] = None

    def finish(self) -> None:
        """Wait for the all-gather and copy every rank's chunk into the full parameters."""
        self.work.wait()
        self.bucket._finish_param_gather(self.gathered, self.tag)


def assign_buckets(
    params: Sequence[ShardedParam],
    group_key: dict[int, object],
    bucket_bytes: int,
    group: collectives.ProcessGroup,
) -> list[Bucket]:
    """Split ``params`` into buckets of at most ``bucket_bytes`` parameter bytes.

    ``params`` should come in the order their gradients are expected (reverse registration order,
    as DDP assumes). Parameters share a bucket only when they have the same dtype and the same
    ``group_key[id(param)]`` (their optimizer), so stepping one optimizer gathers only its buckets.
    A parameter larger than ``bucket_bytes`` is a bucket of its own.
    """
    open_buckets: dict[object, list[ShardedParam]] = {}
    open_bytes: dict[object, int] = {}
    closed: list[list[ShardedParam]] = []
    for p in params:
        key = (group_key[id(p)], p.param.dtype, p.param.device)
        size = p.layout.numel * p.param.element_size()
        if key in open_buckets and open_bytes[key] + size > bucket_bytes:
            closed.append(open_buckets.pop(key))
        if key not in open_buckets:
            open_buckets[key], open_bytes[key] = [], 0
        open_buckets[key].append(p)
        open_bytes[key] += size
    closed.extend(open_buckets.values())
    # launch order: by the position of each bucket's first parameter in the expected order
    position = {id(p): i for i, p in enumerate(params)}
    closed.sort(key=lambda members: position[id(members[0])])
    return [Bucket(i, members, group) for i, members in enumerate(closed)]


class PendingBucketWork(Protocol):
    """A started bucket collective (``PendingGradientReduction`` or ``PendingParamGather``)."""

    def finish(self) -> None: ...


def finish_pipelined(started: Iterable[PendingBucketWork], max_in_flight: int) -> None:
    """Finish every operation ``started`` yields, in order, with at most ``max_in_flight`` unfinished
    at a time: the next one starts (when the iterator is advanced) while earlier ones are in flight,
    and the temporary buffers of at most ``max_in_flight`` buckets exist at once."""
    in_flight: deque[PendingBucketWork] = deque()
    for pending in started:
        in_flight.append(pending)
        if len(in_flight) >= max_in_flight:
            in_flight.popleft().finish()
    while in_flight:
        in_flight.popleft().finish()

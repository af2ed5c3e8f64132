"""A running average of a module's weights (EMA, SWA) kept as this rank's chunks: ``AveragedShards``.

[Note: averaged chunks]
torch's ``AveragedModel``, and Lightning's weight-averaging callbacks built on it, keep a full copy
of the module and average every parameter in place. Here each rank keeps only its chunk of each
parameter's average ([Note: chunk layout] in ``partition.py``), in the dtype of the chunk the
optimizer steps (fp32 where the weights are half precision and trained; a frozen weight's own
dtype, see [Note: frozen chunks] in ``sharded_param.py``) and, unless told otherwise, where that
chunk lives (host memory with offload): 1/N of a full copy per rank, at every stage. An update
reads this rank's chunks of the training weights (the optimizer's, so no communication, at stage 3
neither) and applies the averaging function to them.

The averaging functions torch and Lightning provide (EMA's ``get_ema_avg_fn`` /
``get_ema_multi_avg_fn``, SWA's equal average) are elementwise, so on chunks they give every element
the bits they give it on the whole tensor (checked against DDP in ``tests/test_sharded_averaging.py``).
A user's function is applied the same way and must be elementwise too: it sees flat chunks, and an
``avg_fn`` is called once for all the chunks of one dtype and device laid end to end (with
``offload_params="nvme"``, once per bucket: the training chunks are read in from disk a bucket at
a time, see ``ZeroEngine.buckets_in_memory``).

Buffers are small and replicated: their averages (or copies) are kept whole, as torch keeps them.
Putting the average into the training weights (a swap around validation, the copy at the end)
writes this rank's chunks of the optimizer's weights; at stages 1-2, where every rank keeps the
parameters whole, an all-gather per piece of at most a bucket's size then refreshes them (the
optimizer's own gathers cover its trainable buckets only). At stage 3 the chunks are the weights.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.chunk_gather import all_gather_chunks
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.shards.partition import ChunkLayout
from lightning_zero.engine.shards.sharded_param import ShardedParam, place_of

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``avg_fn(average, current, n_averaged) -> new average`` (torch's ``AveragedModel``)."""
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Tensor], None]
"""``multi_avg_fn(averages, currents, n_averaged)``, updating ``averages`` in place."""


class Buffers(enum.Enum):
    """What the average keeps of the module's buffers."""

    AVERAGED = "averaged"
    """Averaged with the parameters (``AveragedModel(use_buffers=True)``, Lightning's default)."""
    COPIED = "copied"
    """Kept equal to the module's at each update (``use_buffers=False``) and swapped in with the average."""
    NOT_KEPT = "not kept"
    """The average covers the parameters only (Lightning's ``StochasticWeightAveraging``)."""


@dataclass
class AveragedChunk:
    """One parameter's place in the average: its layout, where this rank's training chunk is, and
    this rank's chunk of the average."""

    name: str
    param: nn.Parameter
    sharded: Optional[ShardedParam]
    """The engine's record of the parameter; None where the engine keeps it whole and steps no
    chunk of it (stages 1-2: a parameter in no optimizer)."""
    shape: torch.Size
    """The parameter's full shape (at stage 3 the parameter at rest is an empty placeholder)."""
    layout: ChunkLayout
    rank: int
    average: Tensor = field(default_factory=lambda: torch.empty(0))
    """(owned numel,): a view into its group's flat tensor."""

    @property
    def whole(self) -> bool:
        """The parameter is a full tensor on every rank (stages 1-2)."""
        return self.sharded is None or self.sharded.keeps_full

    def training_chunk(self) -> Tensor:
        """This rank's chunk of the training weight, the optimizer's (fp32 master where kept)."""
        if self.sharded is not None:
            return self.sharded.shard.detach()
        start, end = self.layout.owned_range(self.rank)
        return self.param.detach().view(-1)[start:end]

    def write_training_chunk(self, value: Tensor) -> None:
        if self.sharded is not None:
            self.sharded.load_chunk(value)
        else:
            self.training_chunk().copy_(value)

    def chunk_to_send(self) -> Tensor:
        return self.sharded.chunk_to_send() if self.sharded is not None else self.training_chunk()

    def full_flat(self) -> Tensor:
        """Stages 1-2: the whole parameter, flat, which gathers fill."""
        return self.sharded.gather_target() if self.sharded is not None else self.param.detach().view(-1)


@dataclass
class _ChunkGroup:
    """Chunks of one dtype on one device, whose averages are views of one flat tensor (1D)."""

    chunks: list[AveragedChunk]
    flat: Tensor
    place: str
    """Where ``memory_report`` counts it: "device" or "host"."""

    def training(self) -> Tensor:
        """A copy of this rank's training chunks, end to end, on the average's device."""
        return torch.cat([c.training_chunk().to(self.flat.device) for c in self.chunks])


class AveragedShards:
    """A running average of ``module``'s weights: this rank's chunk of each parameter's average
    (``params``: the engine's sharded parameters; others are chunked here the same way over
    ``group``) and the buffers per ``buffers``. Starts as the current weights, as a copy of the
    module would. See [Note: averaged chunks].

    ``device``: where the averages live (None: beside each chunk the optimizer steps).
    ``comm_device``: where the all-gathers of stages 1-2 and of ``full_state_dict`` stage their
    chunks; ``piece_bytes``: the most bytes of whole parameters one such gather moves;
    ``copies``: the engine's host copies (offload), synchronized before host chunks are written;
    ``buckets_in_memory``: the engine's (``ZeroEngine.buckets_in_memory``), through which every read
    or write of the training chunks goes, one group of parameters at a time (with
    ``offload_params="nvme"`` a bucket, read in from disk for it); None: ``params`` are one group,
    always in memory.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[ShardedParam],
        group: collectives.ProcessGroup,
        comm_device: torch.device,
        piece_bytes: int,
        device: Optional[torch.device] = None,
        buffers: Buffers = Buffers.AVERAGED,
        copies: Optional[CopyStream] = None,
        buckets_in_memory: Optional[Callable[[bool], Iterator[Sequence[ShardedParam]]]] = None,
    ) -> None:
        self.module = module
        self._buckets_in_memory = buckets_in_memory or (lambda writing: iter([params]))
        self.buffers = buffers
        self._group, self._comm_device, self._piece_bytes, self._copies = group, comm_device, piece_bytes, copies
        rank, world_size = collectives.rank(group), collectives.world_size(group)
        sharded = {id(sp.param): sp for sp in params}
        self.chunks: dict[str, AveragedChunk] = {}
        for name, p in module.named_parameters():
            sp = sharded.get(id(p))
            if sp is not None:
                self.chunks[name] = AveragedChunk(name, p, sp, sp.shape, sp.layout, rank)
            else:
                self.chunks[name] = AveragedChunk(name, p, None, p.shape, ChunkLayout(p.numel(), world_size), rank)
        self._by_bucket: list[list[_ChunkGroup]] = []
        """The chunk groups of each of ``buckets_in_memory``'s groups of parameters, in its order
        (parameters the engine steps no chunk of go with the first)."""
        for i, bucket in enumerate(self._buckets_in_memory(False)):
            ids = {id(sp) for sp in bucket}
            members = [c for c in self.chunks.values() if (id(c.sharded) in ids if c.sharded is not None else i == 0)]
            self._by_bucket.append(_groups_of(members, device, rank))  # copies: the current weights
        self._groups = [g for groups in self._by_bucket for g in groups]
        self._buffer_keys = {name: i for i, (name, _) in enumerate(module.named_buffers())}
        self._buffer_averages = (
            [] if buffers is Buffers.NOT_KEPT else [b.detach().to(device or b.device, copy=True) for b in module.buffers()]
        )

    def _in_memory(self, writing: bool) -> Iterator[list[_ChunkGroup]]:
        """The chunk groups of each of the engine's groups of parameters, in turn, while its training
        chunks are in memory (with ``writing``, written back when the next is asked for)."""
        changed = RuntimeError("The engine's buckets changed since this weight average was made.")
        by_bucket = iter(self._by_bucket)
        for _ in self._buckets_in_memory(writing):
            groups = next(by_bucket, None)
            if groups is None:
                raise changed
            yield groups
        if next(by_bucket, None) is not None:
            raise changed

    # ---- averaging -----------------------------------------------------------------------------
    def update(self, n_averaged: Tensor, avg_fn: Optional[AvgFn] = None, multi_avg_fn: Optional[MultiAvgFn] = None) -> None:
        """One step of ``AveragedModel.update_parameters`` with ``n_averaged`` models averaged so far
        (the caller counts): the first copies the training weights, later ones apply ``avg_fn``,
        ``multi_avg_fn`` or, with neither, the equal average, grouped as torch groups them (per
        bucket where the training chunks are read in from disk a bucket at a time)."""
        first = bool(n_averaged == 0)
        with torch.no_grad():
            for i, groups in enumerate(self._in_memory(False)):
                averages = [g.flat for g in groups]
                currents = [g.training() for g in groups]
                if i == 0 and self.buffers is Buffers.AVERAGED:
                    averages += self._buffer_averages
                    currents += [b.detach().to(a.device) for a, b in zip(self._buffer_averages, self.module.buffers())]
                _average(averages, currents, first, n_averaged, avg_fn, multi_avg_fn)
            if self.buffers is Buffers.COPIED:
                for average, b in zip(self._buffer_averages, self.module.buffers()):
                    average.copy_(b.detach())

    # ---- the average into the training weights ---------------------------------------------------
    def swap(self) -> None:
        """Exchange the average and the training weights (Lightning does it around validation)."""
        if self._copies is not None:
            self._copies.synchronize()  # no copy to the device still reads the host chunks
        with torch.no_grad():
            for groups in self._in_memory(True):
                for g in groups:
                    training = g.training()
                    for c in g.chunks:
                        c.write_training_chunk(c.average.reshape(-1))
                    g.flat.copy_(training)
            for average, b in zip(self._buffer_averages, self.module.buffers()):
                kept = average.clone()
                average.copy_(b.detach())
                b.detach().copy_(kept)
        self._gather_whole()

    def copy_to_training(self) -> None:
        """Make the average the training weights (the end of training)."""
        with torch.no_grad():
            self._write_training({name: c.average for name, c in self.chunks.items()})
            for average, b in zip(self._buffer_averages, self.module.buffers()):
                b.detach().copy_(average)
        self._gather_whole()

    def load_training_chunks(self, chunks: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> None:
        """Training weights given as this rank's chunk of each parameter (by name) and whole buffers
        (by ``state_dict`` key), e.g. read from a sharded checkpoint."""
        _check_names(self.chunks, chunks, strict=True)
        with torch.no_grad():
            self._write_training(chunks)
            named = dict(self.module.named_buffers())
            for key, value in buffers.items():
                named[key].detach().copy_(value)
        self._gather_whole()

    def _write_training(self, values: Mapping[str, Tensor]) -> None:
        """Write each chunk's value (by parameter name) into the training chunk, a bucket at a time."""
        if self._copies is not None:
            self._copies.synchronize()  # no copy to the device still reads the host chunks
        for groups in self._in_memory(True):
            for g in groups:
                for c in g.chunks:
                    if c.name in values:
                        c.write_training_chunk(values[c.name].reshape(-1))

    def _gather_whole(self) -> None:
        """Stages 1-2: every rank's new chunks into the whole parameters (stage 3: nothing whole)."""
        self._gather([(c.chunk_to_send(), c.layout, c.full_flat()) for c in self.chunks.values() if c.whole])

    def _gather(self, items: Sequence[tuple[Tensor, ChunkLayout, Optional[Tensor]]]) -> None:
        all_gather_chunks(items, self._group, self._comm_device, self._piece_bytes)

    # ---- state ---------------------------------------------------------------------------------
    def chunk(self, name: str) -> Tensor:
        """This rank's chunk of parameter ``name``'s average."""
        return self.chunks[name].average

    def buffer(self, key: str) -> Optional[Tensor]:
        """The average (or copy) of buffer ``key``; None when the average keeps no buffers."""
        index = self._buffer_keys.get(key)
        return None if index is None or not self._buffer_averages else self._buffer_averages[index]

    def load(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], chunked: bool, strict: bool = True) -> None:
        """Set the average: ``params`` by parameter name, this rank's chunks (``chunked``) or whole
        tensors; ``buffers`` whole, by ``state_dict`` key. ``strict``: every parameter must be given."""
        _check_names(self.chunks, params, strict)
        with torch.no_grad():
            for name, value in params.items():
                c = self.chunks[name]
                if not chunked:
                    start, end = c.layout.owned_range(c.rank)
                    value = value.reshape(-1)[start:end]
                c.average.copy_(value.reshape(-1))
            for key, value in buffers.items():
                average = self.buffer(key)
                if average is not None:
                    average.copy_(value)

    def full_state_dict(self, keep: bool = True) -> dict[str, Tensor]:
        """The average as ``module.state_dict()`` would hold it (tied weights under each key;
        buffers: their averages, or the module's own where none are kept), on the CPU, gathered a
        piece at a time. A collective: ``keep=False`` takes part and returns an empty dict."""
        values = {name: torch.empty(c.layout.numel, dtype=c.average.dtype) if keep else None for name, c in self.chunks.items()}
        self._gather([(c.average, c.layout, values[name]) for name, c in self.chunks.items()])
        if not keep:
            return {}
        first = {id(c.param): name for name, c in self.chunks.items()}
        state = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in first:
                name = first[id(t)]
                state[key] = values[name].view(self.chunks[name].shape)
            else:
                kept = self.buffer(key)
                state[key] = (kept if kept is not None else t).detach().to("cpu", copy=True)
        return state

    def held(self) -> Iterator[tuple[Tensor, str]]:
        """Every tensor of the average, with where ``memory_report`` counts it ("device" or "host")."""
        for g in self._groups:
            yield g.flat, g.place
        for average, b in zip(self._buffer_averages, self.module.buffers()):
            yield average, place_of(average, False, b.device)


def _groups_of(members: Sequence[AveragedChunk], device: Optional[torch.device], rank: int) -> list[_ChunkGroup]:
    """``members``' averages, by dtype and device: per group, a copy of the training chunks end to
    end, each chunk's average a view of it (read while the training chunks are in memory)."""
    by_place: dict[tuple[torch.dtype, torch.device], list[AveragedChunk]] = defaultdict(list)
    for c in members:
        source = c.training_chunk()
        by_place[(source.dtype, torch.device(device) if device is not None else source.device)].append(c)
    groups = []
    for (_, where), chunks in by_place.items():
        flat = torch.cat([c.training_chunk().to(where) for c in chunks])
        for c, view in zip(chunks, torch.split_with_sizes(flat, [c.layout.owned_numel(rank) for c in chunks])):
            c.average = view
        offloaded = any(c.sharded is not None and c.sharded.offloaded for c in chunks)
        groups.append(_ChunkGroup(chunks, flat, place_of(flat, offloaded, chunks[0].param.device)))
    return groups


def _average(
    averages: list[Tensor],
    currents: list[Tensor],
    first: bool,
    n_averaged: Tensor,
    avg_fn: Optional[AvgFn],
    multi_avg_fn: Optional[MultiAvgFn],
) -> None:
    """``AveragedModel.update_parameters`` on the tensors given: the first update copies, later ones
    apply ``avg_fn``, ``multi_avg_fn`` or the equal average."""
    if first:
        for average, current in zip(averages, currents):
            average.copy_(current)
    elif avg_fn is not None and multi_avg_fn is None:
        for average, current in zip(averages, currents):
            average.copy_(avg_fn(average, current, n_averaged.to(average.device)))
    else:
        _apply_multi(averages, currents, n_averaged, multi_avg_fn)


def _apply_multi(
    averages: list[Tensor], currents: list[Tensor], n_averaged: Tensor, multi_avg_fn: Optional[MultiAvgFn]
) -> None:
    """torch's ``AveragedModel`` with ``multi_avg_fn`` or no function: per device and dtype, the given
    function, or the equal average (fused where the device has foreach kernels)."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
    for average, current in zip(averages, currents):
        members = groups[(average.device, average.dtype)]
        members[0].append(average)
        members[1].append(current)
    for (device, _), (group_averages, group_currents) in groups.items():
        n = n_averaged.to(device)
        if multi_avg_fn is not None:
            multi_avg_fn(group_averages, group_currents, n)
        elif device.type in _get_foreach_kernels_supported_devices():
            get_swa_multi_avg_fn()(group_averages, group_currents, n)
        else:
            swa = get_swa_avg_fn()
            for average, current in zip(group_averages, group_currents):
                average.copy_(swa(average, current, n))


def _check_names(chunks: Mapping[str, AveragedChunk], given: Mapping[str, Tensor], strict: bool) -> None:
    unexpected = sorted(set(given) - set(chunks))
    missing = sorted(set(chunks) - set(given)) if strict else []
    if unexpected or missing:
        raise KeyError(f"The averaged weights do not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}.")

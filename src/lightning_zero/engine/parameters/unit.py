"""A ZeRO-3 unit: parameters gathered together just before their module runs and freed after.

[Note: unit tags]
Every rank must gather the same unit at the same point of the step; a forward whose control flow
differs between ranks would otherwise swap weights between modules without an error. So each rank
appends its unit's tag (a small integer, exact in bf16) to its all-gather row, and after the
gather the N tags, still on the device, go to the engine's ``HostReads``: they are read with the
step's used-parameter flags, once per backward (and once per evaluation step), and a disagreement
raises on every rank before an optimizer step can use the wrong weights. No host sync happens in
forward or backward for it.

The price: ranks whose control flow differs can issue different numbers of all-gathers (in
forward, or in backward, where a module called twice in a row is gathered once) and hang before
that read. ``ZeroConfig.check_units_every_gather`` reads every gather's tags as soon as it lands
instead, which fails at the first unit where the ranks disagree. That is the default where the
parameters live in host memory (CPU training: the read waits for nothing); on an accelerator it
is a host sync per all-gather, so there it is the setting to find such a divergence with.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor, nn

from lightning_zero.engine.buckets.bucket import Bucket, PendingParamGather
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.quantized_reduction import QuantizedGradients
from lightning_zero.engine.offload.scratch_files import ScratchDirectory
from lightning_zero.engine.parameters.secondary_shards import BucketSecondary, SecondaryShards
from lightning_zero.engine.shards.at_rest import ParameterAtRest
from lightning_zero.engine.shards.sharded_param import ShardedParam


class UnitState(enum.Enum):
    """Where a unit's parameters are; every transition is checked in :class:`Unit`."""

    SHARDED = "sharded"  # at rest: only this rank's chunks exist
    GATHERING = "gathering"  # all-gather issued (e.g. prefetched), full data not yet in place
    UNSHARDED = "unsharded"  # every parameter is its full tensor


class GatherKind(enum.Enum):
    """What a gather is for, which decides how ZeRO++ sends it (see [Note: ZeRO++] in ``zero_plus_plus.py``)."""

    EXACT = "exact"  # the true weights (``summon_full_params``, state dicts): never quantized, the full group
    FORWARD = "forward"  # a step's forward (training or evaluation): qwZ quantizes it
    BACKWARD = "backward"  # backward's (recomputes included): hpZ gathers from the secondary shards where held


@dataclass(frozen=True)
class UnitCommunication:
    """What every unit's buckets share: the process groups, the buffer pool and the tag reads."""

    reduce_group: collectives.ProcessGroup
    """Gradient reduce-scatters (in bucket order)."""
    gather_group: collectives.ProcessGroup
    """Parameter all-gathers (in forward order, and its reverse in backward)."""
    pool: BufferPool
    verdicts: HostReads
    check_every_gather: bool = False
    """Read each gather's tags at once (see [Note: unit tags])."""
    copies: Optional[CopyStream] = None
    """Host↔device copies of offloaded buckets (see ``host_chunks.py``); None without offload."""
    replicate_group: collectives.ProcessGroup = None
    """Hybrid sharding: where reduced gradient chunks are all-reduced across shard groups."""
    param_files: Optional[ScratchDirectory] = None
    """``offload_params="nvme"``: where the offloaded buckets keep their chunks between uses."""
    weight_format: Optional[str] = None
    """qwZ: the block format weights are all-gathered in ("int8", "fp8"; see ``quantization.py``)."""
    quantized_gradients: Optional[QuantizedGradients] = None
    """qgZ: the block format and the node groups gradients are reduced over (see
    ``quantized_reduction.py``); None: the reduce-scatter."""
    secondary_shards: Optional[SecondaryShards] = None
    """hpZ: the secondary shards' group and generation (see [Note: secondary shards]); None without hpZ."""


class UnitTags:
    """This unit's tag and the check of every rank's tag after a gather (see [Note: unit tags])."""

    def __init__(self, index: int, comm: UnitCommunication) -> None:
        self.tag = index % 251 + 1
        self._comm = comm

    def check(self, gathered: Tensor) -> None:
        """``gathered`` (N,): the tag every rank sent with this gather, on the device."""
        self._comm.verdicts.add(gathered, self._verify)
        if self._comm.check_every_gather:
            self._comm.verdicts.read()

    def _verify(self, tags: list[float]) -> None:
        if tags.count(self.tag) != len(tags):  # every rank's is ours (one C-level count, no generator)
            raise RuntimeError(
                "The ranks gathered different ZeRO-3 units at the same point (unit tags by rank:"
                f" {[int(t) for t in tags]}): the forward took different modules, or a different number"
                " of them, on different ranks. Every rank must run the same modules in the same order;"
                " make data-dependent branches agree across ranks (e.g. decide them on rank 0 and"
                " broadcast), or run such modules outside the sharded units."
            )


class Unit:
    """The parameters of one module (see ``unit_plan``), their buckets and gather/free lifecycle.

    Parameters are bucketed by dtype and trainability: each bucket serves both the unit's
    all-gather and, when trainable, its gradient reduce-scatter (frozen parameters are gathered
    but have nothing to reduce).
    """

    def __init__(self, index: int, name: str, module: nn.Module, params: Sequence[ShardedParam], comm: UnitCommunication) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params = list(params)
        self.state = UnitState.SHARDED
        members: dict[object, list[ShardedParam]] = defaultdict(list)
        for p in self.params:
            members[(p.param.dtype, p.param.requires_grad)].append(p)
        self.buckets = [
            Bucket(
                index, ps, comm.reduce_group, comm.pool, comm.gather_group, comm.copies, comm.replicate_group,
                param_files=comm.param_files, name=f"params-unit{index}-bucket{k}", weight_format=comm.weight_format,
                quantized_gradients=comm.quantized_gradients,
            )
            for k, ps in enumerate(members.values())
        ]  # fmt: skip
        self.tags = UnitTags(index, comm)
        self._pending: list[PendingParamGather] = []
        self._kind = GatherKind.EXACT  # of the gather in flight or done
        self.secondaries: Optional[list[BucketSecondary]] = None
        """hpZ: each bucket's secondary shard, in bucket order (see ``secondary_shards.py``)."""
        if comm.secondary_shards is not None:
            self.secondaries = [comm.secondary_shards.of(bucket) for bucket in self.buckets]
        # the parameters become views of their buckets' storages (see [Note: stage-3 storage] in
        # gathered_storage.py), guarded at rest by their class (see [Note: parameters at rest])
        for bucket in self.buckets:
            for position, p in enumerate(bucket.params):
                p.attach_gathered(bucket.gathered, position)
        self._bucket_params = [[p.param for p in bucket.params] for bucket in self.buckets]
        self._guarded = [p.param for p in self.params if type(p.param) is ParameterAtRest]
        # a parameter of the user's own subclass keeps its class: at rest it shows an empty placeholder
        self._unguarded = [p for p in self.params if type(p.param) is not ParameterAtRest]
        for p in self._unguarded:
            p.hide_values()

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name or '<root>'!r}, params={len(self.params)}, {self.state.value})"

    @property
    def numel(self) -> int:
        return sum(p.layout.numel for p in self.params)

    @property
    def grad_buckets(self) -> list[Bucket]:
        """The buckets of trainable parameters, whose gradients are reduce-scattered."""
        return [b for b in self.buckets if b.params[0].param.requires_grad]

    def read_ahead(self) -> None:
        """Its gather comes after the ones in flight: start reading the chunks that live on disk
        (``offload_params="nvme"``; a no-op otherwise, and once gathered)."""
        if self.state is UnitState.SHARDED:
            for bucket in self.buckets:
                if bucket.host is not None:
                    bucket.host.fetch()

    def start_unshard(self, kind: GatherKind = GatherKind.EXACT) -> None:
        """Issue the all-gather (asynchronously); a no-op unless at rest. ``kind`` decides how ZeRO++
        sends it: a step's gathers quantized with qwZ, backward's from the secondary shards with hpZ
        where every bucket holds one (the same on every rank: see [Note: secondary shards])."""
        if self.state is UnitState.SHARDED:
            pending = self._pending = []  # a loop, not a comprehension: no frame of its own (Python 3.11)
            self._kind = kind
            if kind is GatherKind.BACKWARD and self.secondaries is not None and all(s.holds for s in self.secondaries):
                for secondary in self.secondaries:
                    pending.append(secondary.start_gather(self.tags))
            else:
                quantize = kind is not GatherKind.EXACT
                for bucket in self.buckets:
                    pending.append(bucket.start_param_gather(self.tags, quantize))
            self.state = UnitState.GATHERING

    def unshard(self, kind: GatherKind = GatherKind.EXACT, keep_secondary: bool = False) -> None:
        """Make every parameter its full tensor (waiting for a prefetched gather if one is running).
        ``keep_secondary`` (hpZ): a training forward's gather whose unit backward will gather again
        keeps each bucket's secondary shard as it finishes."""
        if self.state is UnitState.SHARDED:  # not prefetched
            self.start_unshard(kind)
        if self.state is UnitState.GATHERING:
            if keep_secondary and self.secondaries is not None and self._kind is GatherKind.FORWARD:
                for pending, secondary in zip(self._pending, self.secondaries):
                    pending.finish(secondary)
            else:
                for pending in self._pending:
                    pending.finish()
            self._pending = []
            for param in self._guarded:
                param.__class__ = nn.Parameter
            for p in self._unguarded:
                p.point_at_storage()
            self.state = UnitState.UNSHARDED

    def regather(self) -> None:
        """Gather again as last gathered (after the chunks changed), keeping no secondary shard."""
        kind = self._kind
        self.reshard()
        self.unshard(kind)

    def drop_secondary(self) -> None:
        """hpZ: this unit's backward is done with its secondary shards: free them."""
        if self.secondaries is not None:
            for secondary in self.secondaries:
                secondary.free()

    def reshard(self) -> None:
        """Free the full tensors; only the chunks remain."""
        if self.state is UnitState.GATHERING:
            self.unshard()  # a collective in flight must complete on every rank
        if self.state is UnitState.UNSHARDED:
            # `param.data = tensor` while gathered (a callback, a forward): its values are kept;
            # found by one C-level comparison per bucket of where the parameters and the views point
            for bucket, params in zip(self.buckets, self._bucket_params):
                if list(map(Tensor.data_ptr, params)) != list(map(Tensor.data_ptr, bucket.gathered.flats)):
                    _adopt_assigned(bucket)
            for param in self._guarded:
                param.__class__ = ParameterAtRest
            for p in self._unguarded:
                p.hide_values()
            for bucket in self.buckets:
                if not bucket.gathered.free():  # held outside torch: left to its holder
                    bucket.gathered.renew()
                    for p in bucket.params:
                        if type(p.param) is ParameterAtRest:
                            p.point_at_storage()
            self.state = UnitState.SHARDED


def _adopt_assigned(bucket: Bucket) -> None:
    """Each parameter of ``bucket`` whose ``.data`` was assigned while gathered keeps the assigned values."""
    assigned = [p for p, flat in zip(bucket.params, bucket.gathered.flats) if p.param.data_ptr() != flat.data_ptr()]
    for p in assigned:
        p.adopt_assigned_data()

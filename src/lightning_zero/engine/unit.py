"""A ZeRO-3 unit: parameters gathered together just before their module runs and freed after."""

from __future__ import annotations

import enum
from collections import defaultdict
from typing import Sequence

from torch import nn

from lightning_zero.engine import collectives
from lightning_zero.engine.bucket import Bucket, PendingParamGather
from lightning_zero.engine.sharded_param import ShardedParam


class UnitState(enum.Enum):
    """Where a unit's parameters are; every transition is checked in :class:`Unit`."""

    SHARDED = "sharded"  # at rest: only this rank's chunks exist
    GATHERING = "gathering"  # all-gather issued (e.g. prefetched), full data not yet in place
    UNSHARDED = "unsharded"  # every parameter is its full tensor


class Unit:
    """The parameters of one module (see ``unit_plan``) and their gather/free lifecycle."""

    def __init__(self, index: int, name: str, module: nn.Module, params: Sequence[ShardedParam], group: collectives.ProcessGroup) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params = list(params)
        self.state = UnitState.SHARDED
        by_dtype: dict[object, list[ShardedParam]] = defaultdict(list)
        for p in self.params:
            by_dtype[p.param.dtype].append(p)
        self._gather_buckets = [Bucket(index, members, group) for members in by_dtype.values()]
        self._pending: list[PendingParamGather] = []
        # a small integer every rank appends to its all-gather row, so that ranks running
        # different units fail loudly instead of exchanging the wrong weights; exact in bf16
        self.tag = index % 251 + 1

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name or '<root>'!r}, params={len(self.params)}, {self.state.value})"

    @property
    def numel(self) -> int:
        return sum(p.layout.numel for p in self.params)

    def start_unshard(self) -> None:
        """Issue the all-gather (asynchronously); a no-op unless at rest."""
        if self.state is UnitState.SHARDED:
            self._pending = [bucket.start_param_gather(tag=self.tag) for bucket in self._gather_buckets]
            self.state = UnitState.GATHERING

    def unshard(self) -> None:
        """Make every parameter its full tensor (waiting for a prefetched gather if one is running)."""
        self.start_unshard()
        if self.state is UnitState.GATHERING:
            for pending in self._pending:
                pending.finish()
            self._pending = []
            for p in self.params:
                p.show_unsharded()
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the full tensors; only the chunks remain."""
        if self.state is UnitState.GATHERING:
            self.unshard()  # a collective in flight must complete on every rank
        if self.state is UnitState.UNSHARDED:
            for p in self.params:
                p.free_unsharded()
            self.state = UnitState.SHARDED

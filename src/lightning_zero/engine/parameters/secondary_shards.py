"""hpZ: each rank's secondary shards, kept from a unit's forward for its backward's gather within K
ranks (see [Note: ZeRO++] in ``zero_plus_plus.py``).

[Note: secondary shards]
With N ranks in groups of K consecutive ranks (``NodeLinks.secondary``), the rank at position j of
its group keeps, when a training forward's gather of a unit finishes, rows [j·N/K, (j+1)·N/K) of
each bucket's gathered (N, S + 1) rows, in the parameter dtype (with qwZ: of the dequantized rows,
as ZeRO++ does, so backward computes with the very values the forward did). Backward's gather of
that unit (activation checkpointing's recompute included) all-gathers those rows over the K ranks:
K rows-blocks in group order are rows 0..N-1 in rank order, the same (N, S + 1) a full gather
delivers, bit for bit. Each sender first writes its current unit tag over the tag column of its
rows, so the tag check compares what every rank of the group gathers now (a rank of another group
is checked by its own group's gather; the forward's full gather checked them all).

Lifetime: a bucket's rows are allocated when kept (not from the buffer pool: they outlive every
gather between a forward and its backward) and freed when the unit's backward is done with them
(``GatherSchedule._free``) or at the latest at the next step. They must never be used once the
chunks they were gathered from change, so every point where chunks are written advances
``SecondaryShards.generation`` (the optimizer step, loads and writes at rest, ``summon_full_params``'s
write-back, each ``begin_step``) and frees every secondary shard: a secondary shard of an older
generation is never gathered from. Those points are the same on every rank, so every rank of a
group decides alike whether backward's gather takes the secondary group or the full one. As a
check on that list, each kept bucket also records its send chunks' version counters and storages,
and a gather from a secondary shard whose chunks were written in place since raises.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.engine.buckets.pending import PendingParamGather
from lightning_zero.engine.comm import collectives

_SEND_SOURCE = operator.attrgetter("send_source")
_VERSION = operator.attrgetter("_version")


class SecondaryShards:
    """One engine's hpZ: the K-rank ``group``, the chunks' generation, and the buckets' secondary
    shards held now (for ``memory_report``)."""

    def __init__(self, group: collectives.ProcessGroup) -> None:
        self.group = group
        self.size = collectives.world_size(group)  # K
        self.position = collectives.rank(group)  # j: which of the group's N/K-row blocks is this rank's
        self.generation = 0
        self._held: dict[int, "BucketSecondary"] = {}

    def of(self, bucket: Any) -> "BucketSecondary":
        """A bucket's secondary shard (held none yet)."""
        return BucketSecondary(self, bucket)

    def chunks_changed(self) -> None:
        """Chunks are (about to be) written: no secondary shard kept so far may be gathered from."""
        self.generation += 1
        for secondary in list(self._held.values()):
            secondary.free()

    @property
    def held_bytes(self) -> int:
        """Bytes of the secondary shards held now."""
        return sum(s.nbytes for s in self._held.values())


class BucketSecondary:
    """One bucket's secondary shard: this rank's N/K rows of its gathered (N, S + 1) rows."""

    def __init__(self, owner: SecondaryShards, bucket: Any) -> None:
        n = bucket.world_size
        if n % owner.size:
            raise ValueError(f"hpZ's groups of {owner.size} ranks do not divide the {n} ranks a bucket is gathered over.")
        self._owner, self._bucket = owner, bucket
        self.count = n // owner.size
        self._first = owner.position * self.count
        self.rows: Optional[Tensor] = None
        """(N/K, S + 1) in the parameter dtype while held, else None."""
        self._generation = -1
        self._written: list[int] = []  # the send chunks' version counters and data pointers when kept

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() if self.rows is not None else 0

    @property
    def holds(self) -> bool:
        """Whether backward's gather may come from this secondary shard: kept, and no chunk written since."""
        return self.rows is not None and self._generation == self._owner.generation

    def keep(self, rows: Tensor) -> None:
        """Keep this rank's share of a training forward's ``rows`` (N, S [+ columns])."""
        s = self._bucket.shard_numel
        kept = torch.empty(self.count, s + 1, dtype=self._bucket.dtype, device=self._bucket.device)  # (N/K, S + 1)
        kept[:, :s].copy_(rows[self._first : self._first + self.count, :s])
        self.rows, self._generation, self._written = kept, self._owner.generation, self._chunks_written()
        self._owner._held[id(self)] = self

    def free(self) -> None:
        self.rows = None
        self._owner._held.pop(id(self), None)

    def start_gather(self, tags: Any) -> PendingParamGather:
        """Backward's gather of the bucket from the secondary shards of its K-rank group: (N, S + 1)
        rows, as the full gather's (see [Note: secondary shards])."""
        if self._chunks_written() != self._written:
            raise RuntimeError(
                f"hpZ: {self._bucket}'s chunks were written in place after its secondary shard was kept for"
                " backward, at a point that did not advance the shards' generation: backward would compute with"
                " the weights before that write. Report this as a lightning-zero bug (the write point is missing"
                " from [Note: secondary shards])."
            )
        bucket, rows = self._bucket, self.rows
        n, s = bucket.world_size, bucket.shard_numel
        gathered = bucket.pool.take(n * (s + 1), bucket.dtype, bucket.device)  # (N * (S + 1),)
        rows[:, s] = tags.tag  # each sender's tag now (see [Note: unit tags] in ``unit.py``)
        work = collectives.start_all_gather(gathered, rows.view(-1), self._owner.group)
        return PendingParamGather(bucket, work, gathered, tags, lent=[gathered])

    def _chunks_written(self) -> list[int]:
        sources = list(map(_SEND_SOURCE, self._bucket.params))  # C-level maps: no frame per parameter
        return [*map(_VERSION, sources), *map(Tensor.data_ptr, sources)]

"""Which rank writes each entry of a sharded save: DCP's save planner, with every whole entry (one
that every rank holds all of) written by the lowest rank that holds it — rank 0 — as DDP's
checkpoint holds rank 0's.

[Note: which rank writes a whole entry]
Every rank hands DCP the same keys for the entries that are not chunks (``sharded.py``): the buffers,
a parameter no rank shards, an optimizer's step count. DCP keeps one copy of an entry that several
ranks hold, and its default planner picks that copy by load balance: the rank that has been given
the fewest bytes so far (``dedup_save_plans`` in torch). For a parameter every rank holds the same
bits and the choice does not matter; for buffers it does. BatchNorm's running statistics are
updated by each rank's own batch after rank 0's were broadcast before the forward (DDP's
``broadcast_buffers``, which ZeRO does the same way), so the ranks hold different values, and the
balance gave rank 1's to the checkpoint: converted or resumed, a model then evaluated and went on
from other statistics than DDP's, whose checkpoint is rank 0's ``state_dict``. (A load gives every
rank the checkpoint's buffers, as a DDP resume does: ``load_model`` in ``sharded.py``.)

``RankZeroWholeEntries`` keeps each whole entry (DCP's ``WriteItemType.TENSOR`` and ``BYTE_IO``
items) in the plan of the lowest rank that holds it and drops it from every other rank's plan
before DCP's own planning, so DCP finds nothing left to choose for it. A chunk of a DTensor is
left to DCP: one rank holds it, or, on a hybrid mesh, each shard group holds the same bits and
DCP's balance spreads those writes over the groups. The choice depends only on the plans, so it
is the same on every save and every torch release: DCP's ``DefaultSavePlanner.create_global_plan``
takes the ranks' plans and returns theirs from torch 2.6 to 2.14, the override its docs show.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType


def lowest_rank_writes_whole_entries(plans: list[SavePlan]) -> list[SavePlan]:
    """``plans`` (one per rank, by rank) with each whole entry kept by the lowest rank whose plan
    holds it and dropped from the others; chunks (``WriteItemType.SHARD``) as they are."""
    writer: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type != WriteItemType.SHARD:
                writer.setdefault(item.index, rank)
    return [
        dataclasses.replace(plan, items=[i for i in plan.items if i.type == WriteItemType.SHARD or writer[i.index] == rank])
        for rank, plan in enumerate(plans)
    ]


class RankZeroWholeEntries(DefaultSavePlanner):
    """DCP's default save planner, with the whole entries written by rank 0 (see [Note: which rank
    writes a whole entry])."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return super().create_global_plan(lowest_rank_writes_whole_entries(all_plans))

"""Which parameters share a bucket: same optimizer, dtype and device, up to a size, in the order
their gradients are expected."""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_zero.engine.buckets.bucket import Bucket
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.shards.sharded_param import ShardedParam


def assign_buckets(
    params: Sequence[ShardedParam],
    group_key: dict[int, object],
    bucket_bytes: int,
    group: collectives.ProcessGroup,
    pool: Optional[BufferPool] = None,
    copies: Optional[CopyStream] = None,
    replicate_group: collectives.ProcessGroup = None,
    gather_group: collectives.ProcessGroup = None,
) -> list[Bucket]:
    """Split ``params`` into buckets of at most ``bucket_bytes`` parameter bytes.

    ``params`` should come in the order their gradients are expected (reverse registration order,
    as DDP assumes). Parameters share a bucket only when they have the same dtype and the same
    ``group_key[id(param)]`` (their optimizer), so stepping one optimizer gathers only its buckets.
    A parameter larger than ``bucket_bytes`` is a bucket of its own. ``gather_group``: where their
    all-gathers go (default: ``group``).
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
    return [Bucket(i, members, group, pool, copies=copies, replicate_group=replicate_group, gather_group=gather_group) for i, members in enumerate(closed)]

"""What host↔device copies hold beside model state, for the memory report (``memory.py``): the
page-locked host blocks behind the offloaded buckets (:class:`PinnedBlocks`) and the device rows a
copy to the device lands in (:class:`DeviceTemporaries`).

[Note: pinned blocks]
torch serves ``pin_memory=True`` from a caching allocator (``CachingHostAllocator``) that rounds each
block up to a power of two and, when a tensor's storage is freed (``resize_(0)``, or the tensor
dropped), keeps the block for the next request of that size instead of giving it back to the OS:
pinned memory, once allocated, stays for the life of the process (unless someone calls torch's
private ``_host_emptyCache``). So what pinned memory the engine costs is not what its tensors hold
now: with ``offload_params="nvme"`` a master read in from disk and freed again holds nothing by its
storage, yet its block stays pinned. :class:`PinnedBlocks` counts the blocks the engine's buffers
have needed at once, per block size: the allocator keeps at least that many of each size. Where
torch reports its pinned pool (``torch.cuda.host_memory_stats``, CUDA initialized, torch 2.7 on) the count is
capped at the pool, which also holds other users' blocks (a DataLoader's ``pin_memory``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_zero.compat.cuda_memory import pinned_pool_bytes


def pinned_block_bytes(nbytes: int) -> int:
    """The size of the block torch's pinned allocator serves ``nbytes`` from (a power of two)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


class PinnedBlocks:
    """Pinned host blocks one engine's buffers hold or have made the allocator keep (see
    [Note: pinned blocks]). ``taken`` / ``given_back`` as each buffer's storage is allocated or freed."""

    def __init__(self) -> None:
        self._live: Counter[int] = Counter()  # block size -> blocks held now
        self._most: Counter[int] = Counter()  # block size -> most blocks held at once

    def taken(self, nbytes: int) -> None:
        size = pinned_block_bytes(nbytes)
        if size:
            self._live[size] += 1
            self._most[size] = max(self._most[size], self._live[size])

    def given_back(self, nbytes: int) -> None:
        size = pinned_block_bytes(nbytes)
        if size and self._live[size] > 0:
            self._live[size] -= 1

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks the engine's tensors hold now."""
        return sum(size * count for size, count in self._live.items())

    @property
    def held_bytes(self) -> int:
        """Bytes of pinned memory held because of the engine: the blocks its tensors hold now and
        those the allocator keeps cached for them, capped at torch's pinned pool where it reports it."""
        held = sum(size * count for size, count in self._most.items())
        pool = pinned_pool_bytes()
        return held if pool is None else min(held, pool)


@dataclass
class _Row:
    nbytes: int
    read: Any = None
    """An event on the compute stream recorded after the row's consumers were issued (None: not yet)."""


class DeviceTemporaries:
    """The device rows that copies to the device land in (``CopyStream.to_device``), from when each
    is allocated on the copy stream until the compute stream has read it, and the most bytes of them
    at once. A row's memory is free for reuse only once the compute stream passed its use (it is
    recorded there), so each counts until an event recorded on the compute stream after its
    consumers were issued (at the next copy, or the next ``bytes_now``) has completed. The host
    never waits: events are queried (``is_done``). ``record`` makes such an event (None: rows are free
    as soon as the next copy starts, where nothing runs asynchronously)."""

    def __init__(self, record: Optional[Callable[[], Any]] = None, is_done: Optional[Callable[[Any], bool]] = None) -> None:
        self._record = record
        self._is_done = is_done
        self._rows: list[_Row] = []  # rows the compute stream may still read
        self.most_bytes = 0
        """The most bytes of rows in flight at once so far: what torch's caching allocator keeps
        reserved for the copy stream once they are freed."""

    def add(self, row: Tensor) -> None:
        """``row`` was just allocated for a copy; its consumers are issued before the next call."""
        self._settle()
        self._rows.append(_Row(row.numel() * row.element_size()))
        self.most_bytes = max(self.most_bytes, self._sum())

    @property
    def bytes_now(self) -> int:
        """Bytes of the rows the compute stream may still read."""
        self._settle()
        return self._sum()

    def _settle(self) -> None:
        unread = [row for row in self._rows if row.read is None]
        if unread and self._record is not None:
            event = self._record()  # the consumers of every earlier row are issued by now
            for row in unread:
                row.read = event
        self._rows = [row for row in self._rows if row.read is not None and not (self._is_done is None or self._is_done(row.read))]

    def _sum(self) -> int:
        return sum(row.nbytes for row in self._rows)

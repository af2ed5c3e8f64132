"""Where each optimizer state tensor of a bucket sits in its staging buffer and in its scratch file
(see [Note: optimizer state on disk] in ``state_on_disk.py``): the same byte offsets in both, so a
bucket moves between them in one read or write.

Each bucket's file holds two **slots**, each a whole copy of the bucket's state: the *current* one,
which every read reads, and the other, which the next write writes. A write never touches the
current slot, so a step is kept only once the slot it wrote is made current (``commit``: at the end
of ``optimizer.step()``, once every write has finished), and a step undone (a verdict that redoes
it, a step no ``optimizer.step()`` followed) or a write that failed leaves the file as it was
(``discard``): the state before the step is still there, and no host memory holds a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import IO_ALIGNMENT, ScratchFile

ALIGNMENT = 64
"""Bytes each entry's offset is rounded up to, so every view is aligned for vectorized kernels."""


def aligned(offset: int, alignment: int = ALIGNMENT) -> int:
    return -(-offset // alignment) * alignment


@dataclass(frozen=True)
class StateEntry:
    """One per-element state tensor of one parameter, at ``offset`` bytes in its bucket's slot."""

    position: int
    """The parameter's index in the optimizer's ``state_dict`` order."""
    key: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def view(self, buffer: Tensor) -> Tensor:
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype)


def layout_nbytes(entries: list[StateEntry]) -> int:
    """Bytes a slot (and a staging buffer) needs for ``entries``."""
    return aligned(max((e.offset + e.nbytes for e in entries), default=0))


def add_entry(entries: list[StateEntry], position: int, key: str, value: Tensor) -> StateEntry:
    """Append ``value``'s entry to the layout ``entries``, after the last one."""
    entry = StateEntry(position, key, value.dtype, value.numel(), layout_nbytes(entries))
    entries.append(entry)
    return entry


@dataclass(frozen=True)
class Slot:
    """One copy of a bucket's state in its file: at ``offset``, laid out as ``entries``."""

    offset: int
    entries: list[StateEntry]

    @property
    def nbytes(self) -> int:
        return layout_nbytes(self.entries)


@dataclass
class BucketState:
    """The state of one bucket's parameters in one optimizer: its file, its current slot (what the
    optimizer's state is) and the slot a step wrote and no commit has made current yet."""

    positions: list[int]
    file: ScratchFile
    master: Optional[MasterOnDisk] = None
    """Where the bucket's parameter chunks live on disk too (``offload_params="nvme"``): they are
    read, stepped and written with the state."""
    current: Slot = field(default_factory=lambda: Slot(0, []))
    pending: Optional[Slot] = None
    """Written (or being written) by a step, not committed: a read still reads ``current``."""

    @property
    def entries(self) -> list[StateEntry]:
        return self.current.entries

    @property
    def nbytes(self) -> int:
        return self.current.nbytes

    def next_slot(self, entries: list[StateEntry]) -> Slot:
        """Where a write of a layout ``entries`` goes: the start of the file if it ends before the
        current slot begins, else right after the current slot (so the file holds about twice the
        state; a layout that grew, at the first steps, may push it past that once)."""
        nbytes = layout_nbytes(entries)
        cur = self.current
        offset = 0 if cur.offset >= nbytes else aligned(cur.offset + cur.nbytes, IO_ALIGNMENT)
        return Slot(offset, list(entries))

    def commit(self) -> None:
        """The pending slot is now the state (its write has finished)."""
        if self.pending is not None:
            self.current, self.pending = self.pending, None

    def discard(self) -> None:
        """Forget the pending slot: the current one stays the state."""
        self.pending = None

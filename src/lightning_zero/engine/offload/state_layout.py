"""Where each optimizer state tensor of a bucket sits in its scratch file and its staging buffer
(see [Note: optimizer state on disk] in ``state_on_disk.py``): the same byte offsets in both, so a
bucket moves between them in one read or write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import ScratchFile

ALIGNMENT = 64
"""Bytes each entry's offset is rounded up to, so every view is aligned for vectorized kernels."""


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class StateEntry:
    """One per-element state tensor of one parameter, at ``offset`` bytes in its bucket's file."""

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


@dataclass
class BucketState:
    """The state of one bucket's parameters in one optimizer: the file and where each entry sits in it."""

    positions: list[int]
    file: ScratchFile
    entries: list[StateEntry] = field(default_factory=list)
    master: Optional[MasterOnDisk] = None
    """Where the bucket's parameter chunks live on disk too (``offload_params="nvme"``): they are
    read, stepped and written with the state."""

    @property
    def nbytes(self) -> int:
        return aligned(max((e.offset + e.nbytes for e in self.entries), default=0))

    def add_entry(self, position: int, key: str, value: Tensor) -> StateEntry:
        entry = StateEntry(position, key, value.dtype, value.numel(), self.nbytes)
        self.entries.append(entry)
        return entry

"""Sharding math: which elements of a parameter each rank owns, and the padded copies around
collectives.

[Note: chunk layout]
A parameter is sharded on its flattened view with ``torch.chunk`` semantics: with N ranks and
``c = ceil(numel / N)``, rank r owns elements ``[r*c, min((r+1)*c, numel))`` — possibly none, for
a parameter smaller than the world. For the collective every rank's chunk is padded to ``c``, so
the padded parameter is an ``(N, c)`` matrix whose row r is rank r's chunk. A bucket lays its
parameters side by side: its communication buffer is ``(N, S)`` with ``S = sum(c_i)``, parameter i
occupying columns ``[offset_i, offset_i + c_i)``. Row r of that buffer is exactly what rank r sends
to an all-gather or receives from a reduce-scatter. Each rank's shard is therefore a contiguous
piece of each parameter, which is what makes checkpoints reshardable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class ChunkLayout:
    """How one parameter of ``numel`` elements is split over ``world_size`` ranks."""

    numel: int
    world_size: int

    def __post_init__(self) -> None:
        if self.numel < 0 or self.world_size < 1:
            raise ValueError(f"invalid layout: numel={self.numel}, world_size={self.world_size}")

    @property
    def padded_chunk_numel(self) -> int:
        """``c``: every rank's chunk padded to this size for collectives."""
        return -(-self.numel // self.world_size)

    def owned_range(self, rank: int) -> tuple[int, int]:
        """Flat ``[start, end)`` of the elements ``rank`` owns (empty when ``start == end``)."""
        c = self.padded_chunk_numel
        start = min(rank * c, self.numel)
        return start, min(start + c, self.numel)

    def owned_numel(self, rank: int) -> int:
        start, end = self.owned_range(rank)
        return end - start


def copy_flat_into_rows(flat: Tensor, rows: Tensor, scale: Optional[float] = None) -> None:
    """Copy-in: lay ``flat`` (1D, numel ≤ N*c) row by row into ``rows`` (N, c), zeroing the padding,
    multiplied by ``scale`` on the way when given (one pass instead of a copy and a multiply).

    ``rows`` is usually a strided column slice of a bucket's (N, S) buffer. Casts to its dtype.
    """
    n_rows, c = rows.shape
    numel = flat.numel()
    if c == 0:
        return

    def write(dst: Tensor, src: Tensor) -> None:
        if scale is None or dst.dtype != src.dtype:
            dst.copy_(src)
            if scale is not None:
                dst.mul_(scale)
        else:
            torch.mul(src, scale, out=dst)

    full_rows = numel // c
    if full_rows:
        write(rows[:full_rows], flat[: full_rows * c].view(full_rows, c))
    if full_rows < n_rows:
        remainder = numel - full_rows * c
        write(rows[full_rows, :remainder], flat[full_rows * c :])
        rows[full_rows, remainder:].zero_()
        rows[full_rows + 1 :].zero_()


def copy_rows_into_flat(rows: Tensor, flat: Tensor) -> None:
    """Copy-out, the inverse of :func:`copy_flat_into_rows`: fill ``flat`` from ``rows`` (N, c),
    dropping the padding. Casts to ``flat``'s dtype."""
    c = rows.shape[1]
    numel = flat.numel()
    if c == 0:
        return
    full_rows = numel // c
    if full_rows:
        flat[: full_rows * c].view(full_rows, c).copy_(rows[:full_rows])
    remainder = numel - full_rows * c
    if remainder:
        flat[full_rows * c :].copy_(rows[full_rows, :remainder])

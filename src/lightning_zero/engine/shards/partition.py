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
from typing import Optional, Sequence

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


# [Note: batched copies]
# A bucket moves all its parameters through one (N, S) buffer. Copying them one at a time costs a
# handful of operators per parameter (slices, views, copies) — on a GPU, kernel launches and Python
# time proportional to the number of parameters. The functions below do the same copies for a
# whole bucket in a constant number of kernels where torch has the fused operator
# (``_chunk_cat`` for copy-in, ``split_with_sizes_copy`` / ``_foreach_copy_`` for copy-out, the
# operators FSDP2 uses) and fall back to the per-parameter functions above otherwise. The
# per-parameter functions stay the reference the tests compare the batched ones with.
#
# [Note: chunk_cat's metadata]
# On CUDA, ``_chunk_cat`` and ``split_with_sizes_copy`` hand their kernel a table of pointers and
# sizes that they write into pinned host memory and copy to the device with ``non_blocking=True``
# on the current stream: a host-to-device copy on the compute stream, beside the engine's own
# copies (``copy_stream.py``). ``_chunk_cat``'s table has 8 bytes per 2 KiB tile of one row (1/256
# of the row's bytes); at one rank the row is the whole bucket (an offloaded bucket's reduction at
# world size 1: 66-197 KB per bucket of the GPT the H200 run profiled). One row needs no chunking
# and no padding, so there ``torch.cat`` writes the same bytes; it passes its table as a kernel
# argument, with no copy. At N ranks the table (S/256 bytes) stays, as in FSDP2's reduce-scatter:
# the kernel that reads it runs on that stream. ``split_with_sizes_copy`` spreads a large row over
# a bounded number of tiles, so its table stays near 35 KB on an H200 (plus 32 B per parameter).

_CHUNK_CAT = getattr(torch, "_chunk_cat", None)
_SPLIT_COPY = getattr(torch, "split_with_sizes_copy", None)


def pack_rows(flats: Sequence[Tensor], out: Tensor, scale: Optional[float] = None) -> None:
    """Copy-in for a whole bucket: ``copy_flat_into_rows`` of every 1D tensor of ``flats`` into its
    column block of ``out`` (N, S), blocks side by side (widths ``ceil(numel / N)``, padding zeroed),
    multiplied by ``scale`` when given. ``out`` must be exactly as wide as the blocks."""
    n = out.shape[0]
    # a list, not a generator: one Python call, not one per tensor
    fused = _CHUNK_CAT is not None and all([f.numel() > 0 and f.dtype == out.dtype and f.device == out.device for f in flats])
    if fused:
        if n == 1:  # one row, no padding: the same bytes, see [Note: chunk_cat's metadata]
            torch.cat(list(flats), out=out.view(-1))
        else:
            _CHUNK_CAT(list(flats), dim=0, num_chunks=n, out=out)
        if scale is not None:
            out.mul_(scale)
        return
    offset = 0
    for flat in flats:
        width = -(-flat.numel() // n)
        copy_flat_into_rows(flat, out[:, offset : offset + width], scale=scale)
        offset += width


def unpack_rows(
    rows: Tensor,
    targets: Sequence[Tensor],
    widths: Sequence[int],
    target_rows: Optional[Sequence[Optional[Tensor]]] = None,
    all_exact: bool = False,
) -> None:
    """Copy-out for a whole bucket: ``copy_rows_into_flat`` of each column block of ``rows`` (N, S')
    into its 1D target. ``widths`` are the blocks' widths, side by side from column 0; columns past
    them (e.g. a tag) are ignored. ``target_rows``: each target already viewed as (N, width) where
    it fills whole rows (None elsewhere), so that no view is made per call. ``all_exact``: the
    caller knows every target row is given, in ``rows``' dtype and device (stage 3's storage,
    decided at setup), so nothing is checked per parameter and call."""
    n = rows.shape[0]
    extra = rows.shape[1] - sum(widths)
    if all_exact and _SPLIT_COPY is not None:
        _SPLIT_COPY(rows, [*widths, extra], dim=1, out=[*target_rows, torch.empty(n, extra, dtype=rows.dtype, device=rows.device)])
        return
    if target_rows is None:
        target_rows = [t.view(n, w) if t.numel() == n * w else None for t, w in zip(targets, widths)]
    exact = [r is not None and r.dtype == rows.dtype and r.device == rows.device for r in target_rows]
    if _SPLIT_COPY is not None and all(exact):
        scratch = torch.empty(n, extra, dtype=rows.dtype, device=rows.device)
        _SPLIT_COPY(rows, [*widths, extra], dim=1, out=[*target_rows, scratch])
        return
    blocks = torch.split_with_sizes(rows, [*widths, extra], dim=1)[: len(widths)]
    whole = [(r, b) for r, b, e in zip(target_rows, blocks, exact) if e]
    if whole:
        torch._foreach_copy_([t for t, _ in whole], [b for _, b in whole])
    for target, block, e in zip(targets, blocks, exact):
        if not e:
            copy_rows_into_flat(block, target)


def interleaved_sizes(owned: Sequence[int], widths: Sequence[int]) -> list[int]:
    """Split sizes that cut a rank's row (S) into [chunk 0, padding 0, chunk 1, padding 1, ...]: the
    even pieces are this rank's chunks (``owned`` elements of each ``widths``-wide block)."""
    return [size for o, w in zip(owned, widths) for size in (o, w - o)]

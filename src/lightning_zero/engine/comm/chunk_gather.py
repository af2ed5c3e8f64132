"""Whole tensors from every rank's flat chunks, a bounded piece at a time.

Used where full tensors are wanted outside the step's buckets: a weight average's full values
(``averaged_shards.py``) and the full gradients of ``summon_full_params(with_grads=True)``
(``grad_window.py``). One all-gather per piece of same-dtype items of at most ``piece_bytes``, so no
more than a piece is in flight beyond what the caller keeps.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shards.partition import ChunkLayout, interleaved_sizes, unpack_rows

ChunkItem = tuple[Tensor, ChunkLayout, Optional[Tensor]]
"""(this rank's chunk, 1D; how the whole tensor is laid out; the whole flat tensor to fill, or None
to take part only)."""


def all_gather_chunks(
    items: Sequence[ChunkItem],
    group: collectives.ProcessGroup,
    device: torch.device,
    piece_bytes: int,
) -> None:
    """All-gather each item's chunk (1D: this rank's part of a flat tensor laid out by its
    ``ChunkLayout``) into its target (the whole flat tensor; None: take part only), staged on
    ``device``, one collective per piece of items of one dtype and at most ``piece_bytes``."""
    n = collectives.world_size(group)
    for piece in _pieces(items, piece_bytes):
        widths = [layout.padded_chunk_numel for _, layout, _ in piece]
        send = torch.empty(sum(widths), dtype=piece[0][0].dtype, device=device)  # (S,); padding is never read
        slots = torch.split_with_sizes(send, interleaved_sizes([chunk.numel() for chunk, _, _ in piece], widths))
        with torch.no_grad():
            torch._foreach_copy_(list(slots[0::2]), [chunk.to(device) for chunk, _, _ in piece])
        gathered = torch.empty(n * send.numel(), dtype=send.dtype, device=device)  # (N * S,)
        collectives.start_all_gather(gathered, send, group).wait()
        targets = [target for _, _, target in piece]
        if all(t is not None for t in targets):
            with torch.no_grad():
                unpack_rows(gathered.view(n, -1), targets, widths)


def _pieces(items: Sequence[ChunkItem], piece_bytes: int) -> Iterator[list]:
    """``items`` by dtype, in order, cut where a piece would exceed ``piece_bytes`` of whole tensors."""
    by_dtype: dict[torch.dtype, list] = defaultdict(list)
    for item in items:
        by_dtype[item[0].dtype].append(item)
    for members in by_dtype.values():
        piece, size = [], 0
        for item in members:
            nbytes = item[1].numel * item[0].element_size()
            if piece and size + nbytes > piece_bytes:
                yield piece
                piece, size = [], 0
            piece.append(item)
            size += nbytes
        if piece:
            yield piece

"""Moving whole tensors between their chunks (every rank holds one) and their owner rank (which
holds it whole): the two all-to-alls of the whole-tensor optimizer step (``whole_tensor_step.py``).

``gather_to_owners``: every rank sends its chunk of each tensor to the tensor's owner, which lays the
chunks end to end (chunk r is elements ``layout.owned_range(r)``, see [Note: chunk layout]).
``scatter_from_owners``: the inverse. Per call and dtype one all-to-all, whatever the number of
tensors: rank r's send buffer holds, for each destination in rank order, its pieces of the tensors
that destination needs, in index order, so every rank knows every split size from the layouts alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shards.partition import ChunkLayout


@dataclass(frozen=True)
class OwnedTensor:
    """A tensor sharded like a parameter (``layout``) whose whole value lives on rank ``owner``."""

    layout: ChunkLayout
    owner: int


def gather_to_owners(
    chunks: Sequence[Tensor], tensors: Sequence[OwnedTensor], group: collectives.ProcessGroup, device: torch.device
) -> dict[int, Tensor]:
    """``chunks[i]``: this rank's chunk of tensor i (1-D). Returns, on each rank, the tensors it owns,
    whole and flat on ``device``, by index (a collective: every rank calls it with the same ``tensors``)."""
    rank, n = collectives.rank(group), collectives.world_size(group)
    full: dict[int, Tensor] = {}
    for dtype, indices in _by_dtype(chunks).items():
        sends = [[chunks[i].reshape(-1) for i in indices if tensors[i].owner == dest] for dest in range(n)]
        mine = [i for i in indices if tensors[i].owner == rank]
        received = _exchange(sends, [[tensors[i].layout.owned_numel(src) for i in mine] for src in range(n)], dtype, group, device)
        for position, i in enumerate(mine):
            full[i] = torch.cat([pieces[position] for pieces in received])
    return full


def scatter_from_owners(
    full: Mapping[int, Tensor], tensors: Sequence[OwnedTensor], out: Sequence[Tensor], group: collectives.ProcessGroup, device: torch.device
) -> None:
    """The inverse of ``gather_to_owners``: every rank's ``out[i]`` (1-D, its chunk of tensor i)
    receives its elements of ``full[i]``, which tensor i's owner holds whole (a collective)."""
    rank, n = collectives.rank(group), collectives.world_size(group)
    for dtype, indices in _by_dtype(out).items():
        mine = [i for i in indices if tensors[i].owner == rank]
        sends = [[_elements(full[i], tensors[i].layout, dest) for i in mine] for dest in range(n)]
        from_owner = [[i for i in indices if tensors[i].owner == src] for src in range(n)]
        received = _exchange(sends, [[out[i].numel() for i in members] for members in from_owner], dtype, group, device)
        with torch.no_grad():
            for members, pieces in zip(from_owner, received):
                for i, piece in zip(members, pieces):
                    out[i].copy_(piece.view_as(out[i]))


def _elements(flat: Tensor, layout: ChunkLayout, rank: int) -> Tensor:
    start, end = layout.owned_range(rank)
    return flat.reshape(-1)[start:end]


def _by_dtype(tensors: Sequence[Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _exchange(
    sends: list[list[Tensor]], receive_sizes: list[list[int]], dtype: torch.dtype, group: collectives.ProcessGroup, device: torch.device
) -> list[list[Tensor]]:
    """One all-to-all: ``sends[d]`` go to rank d; from rank s arrive pieces of ``receive_sizes[s]``
    elements, returned split so. Buffers on ``device`` (NCCL moves device tensors only)."""
    input_splits = [sum(t.numel() for t in pieces) for pieces in sends]
    flat = [t for pieces in sends for t in pieces]
    inputs = torch.cat(flat).to(device, dtype) if flat else torch.empty(0, dtype=dtype, device=device)
    output_splits = [sum(sizes) for sizes in receive_sizes]
    output = torch.empty(sum(output_splits), dtype=dtype, device=device)
    collectives.all_to_all(output, inputs, output_splits, input_splits, group)
    return [list(segment.split(sizes)) for segment, sizes in zip(output.split(output_splits), receive_sizes)]

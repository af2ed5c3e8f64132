"""Stage 3: a bucket's full parameters in one storage, grown for a gather and freed after.

[Note: stage-3 storage]
Each stage-3 bucket (one unit's parameters of one dtype and trainability) owns one flat tensor,
``flat``, holding its parameters' full values end to end; every parameter's ``.data`` is a view of
it, made once at setup and never swapped. Gathering grows ``flat``'s storage (one
``untyped_storage().resize_``) and the all-gather's copy-out fills the views; releasing shrinks it
to 0 bytes (one more resize). Memory is really freed, also under the references autograd saved
for backward: those are views of the same storage, so when backward's gather grows it again and
refills it they see the weights again, with no graph surgery. A bucket costs two resizes per
gather/release cycle, whatever its number of parameters, and no per-parameter ``.data`` or class
swap (the at-rest guard switches once per unit, see [Note: parameters at rest] in ``at_rest.py``).

A parameter keeps its true shape at rest (``numel()``, ``shape``, ``sum(p.numel() ...)`` agree
with DDP), only its values are refused there.

Two cases leave the shared storage, both outside the step:

- a parameter whose ``.data`` a callback assigned between steps, inside the gathered context (e.g.
  Lightning's ModelPruning, which keeps the tensor it assigned and reads it again later), keeps
  that tensor as its own storage from then on (``own``): gathers fill it too, releases free it;
- a storage someone pinned outside torch (``.numpy()`` inside ``summon_full_params``) cannot be
  shrunk: the bucket leaves it to them, with its values, and makes a new flat tensor (``renew``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.shards.host_work import HOST_WORK
from lightning_zero.engine.shards.partition import ChunkLayout, unpack_rows


class GatheredStorage:
    """The full values of ``layouts``' parameters (``shapes``), one flat ``dtype`` tensor on
    ``device``; created freed (0 bytes)."""

    def __init__(self, layouts: Sequence[ChunkLayout], shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device) -> None:
        self._layouts = list(layouts)
        self._widths = [layout.padded_chunk_numel for layout in self._layouts]  # each one's block of a row, c_i
        self._shapes = list(shapes)
        self.dtype, self.device = dtype, device
        self.views: list[Tensor] = []
        """Each parameter's full value, shaped: what its ``.data`` is."""
        self.flats: list[Tensor] = []
        """The same, 1D: where the copy-out of an all-gather writes."""
        self.rows: list[Optional[Tensor]] = []
        """The same as the (N, c) block an all-gather delivers, where the parameter fills whole rows
        (numel = N * c), else None (see [Note: batched copies] in ``partition.py``)."""
        self._owned: dict[int, Tensor] = {}  # index -> a tensor that is that parameter's own storage
        self._make_flat()

    def _make_flat(self) -> None:
        numels = [layout.numel for layout in self._layouts]
        self.flat = torch.empty(sum(numels), dtype=self.dtype, device=self.device)  # (sum numel_i,)
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self._storages = [self.flat.untyped_storage()]
        self._nbytes = [self.nbytes]  # each of ``_storages``' size when grown
        self.views, self.flats, self.rows = [], [], []
        offset = 0
        for layout, shape, numel in zip(self._layouts, self._shapes, numels):
            flat = self.flat[offset : offset + numel]
            offset += numel
            self._place(flat, flat.view(shape), layout)
        for index, tensor in self._owned.items():
            self._own(index, tensor)
        self._rows_changed()
        self.free()

    def _place(self, flat: Tensor, view: Tensor, layout: ChunkLayout, index: Optional[int] = None) -> None:
        n, c = layout.world_size, layout.padded_chunk_numel
        rows = flat.view(n, c) if c > 0 and layout.numel == n * c else None
        if index is None:
            self.views.append(view)
            self.flats.append(flat)
            self.rows.append(rows)
        else:
            self.views[index], self.flats[index], self.rows[index] = view, flat, rows

    def fill(self, rows: Tensor) -> None:
        """Grow, then copy an all-gather's ``rows`` (N, S [+ columns after the chunks, e.g. a tag], of
        ``dtype`` on ``device``) into every parameter's view: one ``split_with_sizes_copy`` where
        each fills whole rows (decided here once, not per gather: see [Note: batched copies] in
        ``partition.py``)."""
        self.grow()
        unpack_rows(rows, self.flats, self._widths, self.rows, all_exact=self._whole_rows)

    @property
    def is_grown(self) -> bool:
        return self._storages[0].nbytes() != 0 or self.nbytes == 0

    def grow(self) -> None:
        """Allocate the storage again (a no-op while allocated); its values are undefined until a
        gather fills them."""
        if self._storages[0].nbytes() == 0 and self.nbytes:
            for storage, nbytes in zip(self._storages, self._nbytes):
                storage.resize_(nbytes)
                HOST_WORK.storage_resizes += 1

    def free(self) -> bool:
        """Release the storage (0 bytes; the views keep their shapes). False where a storage could
        not be shrunk (held outside torch); the caller then ``renew``s before the next use."""
        if self._storages[0].nbytes() == 0:
            return True
        if not all(map(torch.UntypedStorage.resizable, self._storages)):  # no Python frame per gather
            return False
        for storage in self._storages:
            storage.resize_(0)
            HOST_WORK.storage_resizes += 1
        return True

    def renew(self) -> None:
        """A new flat tensor (freed), the old one left to whoever holds it; the caller points the
        parameters at the new ``views``."""
        self._owned = {i: t for i, t in self._owned.items() if t.untyped_storage().resizable()}
        self._make_flat()

    def own(self, index: int, tensor: Tensor) -> None:
        """Parameter ``index`` keeps ``tensor`` (contiguous, its full shape, resizable) as its own
        storage from now on: gathers fill it, releases free it (see the module's docstring)."""
        self._owned[index] = tensor
        self._own(index, tensor)

    def _own(self, index: int, tensor: Tensor) -> None:
        self._place(tensor.view(-1), tensor, self._layouts[index], index)
        self._storages = [self.flat.untyped_storage()] + [t.untyped_storage() for t in self._owned.values()]
        self._nbytes = [self.nbytes] + [t.numel() * t.element_size() for t in self._owned.values()]
        self._rows_changed()

    def _rows_changed(self) -> None:
        flat = self.flat  # the rows an all-gather delivers are its dtype and device
        self._whole_rows = all(r is not None and r.dtype == flat.dtype and r.device == flat.device for r in self.rows)

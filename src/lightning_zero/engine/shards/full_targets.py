"""Stages 1-2: a group of full parameters (a bucket's) as a step reads them, once per group.

After every backward the engine asks whether a parameter's ``.data`` was assigned, and after every
optimizer step it asks again and writes the gathered chunks into the full parameters. Asked of each
``ShardedParam`` (``data_was_assigned``, ``gather_target``), that is a few Python calls per
parameter per step; here it is asked of a whole group with ``map`` over C functions
(``Tensor.data_ptr``, ``operator.attrgetter``), which make no Python call per parameter, and the
write-back's target lists are kept until some parameter's storage changes (an assigned tensor
adopted, ``ShardedParam.adopt_assigned_data``). The answers are the per-parameter ones exactly:
where the check finds an assignment, the caller takes the per-parameter path, whose errors name
the parameter (see STYLE item 13: the per-parameter loop stays as the fallback and the oracle).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.shards.sharded_param import ShardedParam

_PLACED_PTR = attrgetter("placed_ptr")
_FULL_FLAT = attrgetter("full_flat")
_FULL_ROWS = attrgetter("full_rows")
_SEND_SOURCE = attrgetter("send_source")


class FullTargets:
    """``params`` (each keeping its full parameter: ``keeps_full``), checked and written as one."""

    def __init__(self, params: Sequence[ShardedParam]) -> None:
        if not all(p.keeps_full for p in params):
            raise ValueError("FullTargets holds parameters kept full (stages 1-2) only")
        self.params = list(params)
        self._tensors = [p.param for p in self.params]  # the parameter objects stay; their `.data` may not
        self._copied = [p for p in self.params if not p.aliases_param]
        """Those whose shard is not a view of the parameter (fp32 masters of half parameters,
        offloaded chunks): at world size 1 the only ones a write-back copies."""
        self._placed: Optional[list[int]] = None  # the storages the lists below were made for
        self._flats: list[Tensor] = []
        self._rows: list[Optional[Tensor]] = []

    def assigned(self) -> bool:
        """Whether some parameter's ``.data`` was assigned (``ShardedParam.data_was_assigned`` of any)."""
        return list(map(Tensor.data_ptr, self._tensors)) != list(map(_PLACED_PTR, self.params))

    def check_not_assigned(self) -> None:
        """``ShardedParam.check_data_not_assigned`` of each parameter (the first assigned one raises)."""
        if self.assigned():
            for p in self.params:
                p.check_data_not_assigned()

    def targets(self) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """Each parameter's ``full_flat`` and ``full_rows``: what an all-gather unpacks into
        (``partition.unpack_rows``). Remade only after a parameter's storage changed."""
        placed = list(map(_PLACED_PTR, self.params))
        if placed != self._placed:
            self._placed = placed
            self._flats = list(map(_FULL_FLAT, self.params))
            self._rows = list(map(_FULL_ROWS, self.params))
        return self._flats, self._rows

    def copy_whole_chunks(self) -> None:
        """World size 1 (the chunk is the whole parameter): copy the shards that do not alias their
        parameter into it, in the parameter's dtype, in one fused copy."""
        if self._copied:
            torch._foreach_copy_(list(map(_FULL_FLAT, self._copied)), list(map(_SEND_SOURCE, self._copied)))

"""A bucket's chunks and optimizer state as they were before a step taken ahead of its verdict, so
that the step can be undone bit for bit (see [Note: the host step during backward] in
``step_ahead.py``).

The copies live in ordinary host memory (the step reads them only on a rollback; nothing crosses to
a device), allocated the first time a bucket is saved with state of that shape and reused by every
later save: after the first steps no host memory is allocated.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.device_roles import mark_host


class RollbackCopy:
    """One bucket's ``master`` row and the optimizer state of its ``shards`` (views of that row)."""

    def __init__(self, master: Tensor, shards: Sequence[Tensor]) -> None:
        self._master = master
        self._shards = list(shards)
        self._saved_master = mark_host(torch.empty_like(master, device="cpu"))
        self._saved: dict[int, dict[str, Any]] = {}
        """Per shard (by position): the state entries as saved, tensors in buffers kept for reuse."""
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._had_state: list[bool] = [False] * len(self._shards)

    def save(self, state: dict[Tensor, dict[str, Any]]) -> None:
        """Copy the master row and the state ``state`` (the optimizer's) holds for the shards now."""
        self._saved_master.copy_(self._master)
        for i, shard in enumerate(self._shards):
            entries = state.get(shard)
            self._had_state[i] = entries is not None
            saved: dict[str, Any] = {}
            for key, value in (entries or {}).items():
                if isinstance(value, Tensor):
                    buffer = self._buffers.get((i, key))
                    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                        buffer = self._buffers[(i, key)] = mark_host(torch.empty_like(value, device="cpu"))
                    buffer.copy_(value)
                    saved[key] = buffer
                else:
                    saved[key] = value  # a Python number (an old optimizer's step count): immutable
            self._saved[i] = saved

    def restore(self, state: dict[Tensor, dict[str, Any]]) -> None:
        """Put back what ``save`` copied: the master row, and each shard's state entries (a shard that
        had none has none again; an entry the step added goes)."""
        self._master.copy_(self._saved_master)
        for i, shard in enumerate(self._shards):
            if not self._had_state[i]:
                state.pop(shard, None)
                continue
            saved, entries = self._saved[i], state[shard]
            for key in [key for key in entries if key not in saved]:
                del entries[key]
            for key, value in saved.items():
                current = entries.get(key)
                if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
                    current.copy_(value)
                else:
                    entries[key] = value.clone() if isinstance(value, Tensor) else value

    @property
    def nbytes(self) -> int:
        """Host bytes these copies hold."""
        buffers = [self._saved_master, *self._buffers.values()]
        return sum(b.numel() * b.element_size() for b in buffers)

"""Per-parameter state, kept in one typed object rather than attributes stuck onto ``nn.Parameter``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_zero.engine.partition import ChunkLayout

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class ShardedParam:
    """One ``nn.Parameter`` of the module, its layout and this rank's chunk of it.

    ``shard`` is the tensor the optimizer steps in place of the parameter (its ``param_groups`` are
    rebound to it). Its dtype is the master dtype: fp32 where the parameter is half precision (then
    ``shard`` owns a separate fp32 copy of the chunk), otherwise the parameter's own dtype (then
    ``shard`` is a view into the parameter's storage, so stepping it updates the parameter's own
    chunk in place and costs no memory).
    """

    def __init__(self, name: str, param: nn.Parameter, rank: int, world_size: int) -> None:
        if not param.is_contiguous():
            # sharding works on the flat view; this happens at setup only
            param.data = param.data.contiguous()
        self.name = name
        self.param = param
        self.rank = rank
        self.layout = ChunkLayout(param.numel(), world_size)
        self.holds_master_copy = param.dtype in _HALF_DTYPES
        chunk = self._owned_chunk()  # 1D view into the parameter
        shard_data = chunk.detach().to(torch.float32, copy=True) if self.holds_master_copy else chunk.detach()
        self.shard = nn.Parameter(shard_data, requires_grad=param.requires_grad)
        self._storage_ptr = param.data_ptr()

    @property
    def owned_numel(self) -> int:
        return self.layout.owned_numel(self.rank)

    @property
    def padded_chunk_numel(self) -> int:
        return self.layout.padded_chunk_numel

    def _owned_chunk(self) -> Tensor:
        start, end = self.layout.owned_range(self.rank)
        return self.param.detach().view(-1)[start:end]

    def accumulate_grad(self, grad_shard: Tensor) -> None:
        """Add this rank's reduced gradient chunk to ``shard.grad`` (set it on the first call)."""
        if self.shard.grad is None:
            self.shard.grad = grad_shard.to(self.shard.dtype, copy=True)
        else:
            self.shard.grad.add_(grad_shard)

    def write_chunk_to(self, out: Tensor) -> None:
        """Copy this rank's (updated) chunk into ``out`` (1D, ``owned_numel`` long), in ``out``'s dtype."""
        out.copy_(self.shard.detach())

    def check_storage_unchanged(self) -> None:
        """Fail loudly when the parameter's storage was replaced after setup, e.g. by
        ``module.to(...)`` or assigning ``param.data``: the shard would silently stop aliasing it."""
        if self.param.data_ptr() != self._storage_ptr or self.param.numel() != self.layout.numel:
            raise RuntimeError(
                f"Parameter {self.name!r} was replaced or resized after lightning-zero sharded it"
                f" (now shape {tuple(self.param.shape)}). Move, cast or resize the model before"
                " `trainer.fit` (or in `configure_model`), never during training."
            )

    def sync_master_from_param(self) -> None:
        """Refresh the fp32 master chunk from the parameter (after the weights were loaded)."""
        if self.holds_master_copy:
            with torch.no_grad():
                self.shard.copy_(self._owned_chunk())

    def optimizer_state_bytes(self, state: Optional[dict]) -> int:
        if not state:
            return 0
        return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))

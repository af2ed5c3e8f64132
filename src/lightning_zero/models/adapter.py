"""A trainable low-rank residual, LoRA's shape, for fine-tuning a frozen base in the benchmark and
the tests of frozen weights."""

from __future__ import annotations

import torch
from torch import nn


class Adapter(nn.Module):
    """``x + up(down(x))`` with ``down``: width -> rank and ``up``: rank -> width, both trainable.
    Placed in an ``nn.ModuleList`` beside a frozen model's blocks, each adapter is a stage-3 unit of
    its own and each block an all-frozen one."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., width) -> (..., width)
        return x + self.up(self.down(x))

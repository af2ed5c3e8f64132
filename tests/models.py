"""Small models whose parameter shapes exercise the sharding edge cases."""

from __future__ import annotations

import torch
from torch import nn


class OddShapes(nn.Module):
    """Parameters whose numel is odd, smaller than the world size, 0-dimensional, or LayerNorm-sized;
    optionally a branch that never receives a gradient."""

    def __init__(self, width: int = 13, with_unused_branch: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)  # 91-element weight: not divisible by 2 or 4
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width, bias=False)
        self.out = nn.Linear(width, 3)
        self.tiny = nn.Parameter(torch.randn(1))  # smaller than the world size
        self.scalar = nn.Parameter(torch.tensor(0.5))  # 0-dimensional
        self.unused = nn.Linear(width, width) if with_unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = h + torch.relu(self.hidden(h)) * self.scalar
        return self.out(h) * self.tiny


def batches(rank: int, steps: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on every rank, as a DistributedSampler would give."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, 7, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(steps)]

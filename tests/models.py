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


class ConvBatchNorm(nn.Module):
    """Conv2d, BatchNorm2d and Linear on (B, 2, 4, 4) images (no torchvision): BatchNorm's running
    statistics are buffers that every rank updates from its own batch, so ranks that see different
    data hold different ones after each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.out = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.conv(x))).flatten(1))  # (B, 2, 4, 4) -> (B, 3)

"""A fine-tuning model for tests of frozen weights: a frozen base with small trainable adapters,
and the sizes the engine's gathers and memory report follow from."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.models.adapter import Adapter

IN_FEATURES, OUT_FEATURES = 7, 3


class FrozenBlock(nn.Module):
    """A unit of frozen weights (the base model's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class LoraStack(nn.Module):
    """``inp`` (frozen) and ``head`` (trainable) in the root unit; ``layers``: adapter, frozen block,
    adapter, frozen block, ... (each its own stage-3 unit). Every frozen block's output needs a
    gradient (an adapter before it is trained), so its weights are needed in backward too."""

    def __init__(self, width: int = 32, blocks: int = 3, out_features: int = OUT_FEATURES) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, width)
        self.inp.requires_grad_(False)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [Adapter(width), FrozenBlock(width)]
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def frozen_blocks(self) -> list[FrozenBlock]:
        return [m for m in self.layers if isinstance(m, FrozenBlock)]


def chunk_numel(numel: int, world_size: int) -> int:
    """One rank's chunk of a parameter, padded to equal size (``torch.chunk`` semantics)."""
    return -(-numel // world_size)


def gather_bytes(params: list[nn.Parameter], world_size: int, tagged: bool = True) -> int:
    """Bytes of one stage-3 all-gather of ``params`` (one bucket): N rows of their chunks, plus the
    unit tag each rank appends to its row (see [Note: unit tags])."""
    row = sum(chunk_numel(p.numel(), world_size) for p in params) + tagged
    return world_size * row * params[0].element_size()


def full_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def frozen_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if not p.requires_grad)

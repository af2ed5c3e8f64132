"""A LightningModule that imports nothing of lightning-zero, so that a pickle of it names nothing of
lightning-zero either: what a user's module pickled inside ``fit`` must load without it."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn


class SequentialRegression(L.LightningModule):
    """Regression through ``nn.Sequential`` layers (each Linear a stage-3 unit, gathered by its own
    hooks), a LayerNorm and a scalar in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 9), nn.LayerNorm(9), nn.Linear(9, 5), nn.Linear(5, 3))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

"""Stage 3's gather schedule in one process (world size 1 takes the same gather/free path)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class CalledTwiceInARow(nn.Module):
    """``blocks[0]`` runs twice back to back: one call's output is the next call's input, so the
    two calls' backward hooks fire on the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](self.blocks[0](x))).pow(2).mean()


def test_a_module_called_twice_in_a_row_stays_gathered_for_both_backwards():
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    reference = CalledTwiceInARow()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3))
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        reference(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.begin_step()
        model(x).backward()  # freed mid-backward, this raised a storage error
        engine.finish_backward()
        engine.end_step()
        opt.step()
        engine.after_optimizer_step(opt)
        opt.zero_grad()
    engine.release_parameters(torch.device("cpu"))
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name

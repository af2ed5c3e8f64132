"""A plain Fabric training loop on the tests' small GPT, shared by ``test_fabric.py`` and
``test_compile.py`` (which runs its ``torch.compile`` cases, next to the Trainer's, in ranks that
have compiled already): the strategy by name, each rank's batches, the full weights after it, and
the comparison of two runs' results."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import pytest
import torch
from case_groups import RankContext

STEPS = 4


def fabric_for(strategy: str, precision: str = "32-true", accelerator: str = "cpu", num_nodes: int = 1, **options: Any):
    from datetime import timedelta

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    from multiprocess import ranks_started

    from lightning_zero import ZeroFabricStrategy

    timeout = timedelta(seconds=60)  # a hang becomes an error
    if strategy == "ddp":
        chosen = DDPStrategy(timeout=timeout)
    else:
        chosen = ZeroFabricStrategy(stage=int(strategy[-1]), timeout=timeout, **options)
    devices = ranks_started() // num_nodes
    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=chosen, precision=precision)
    fabric.launch()
    return fabric


def small_gpt() -> torch.nn.Module:
    from lightning_zero.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))


def batches_for(rank: int, count: int, batch_size: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as a sampler gives
    return [torch.randint(0, 256, (batch_size, 17), generator=g) for _ in range(count)]


def full_weights(fabric: Any, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().float() for k, v in fabric.strategy.get_module_state_dict(model.module).items()}


def train(
    ctx: RankContext,
    strategy: str,
    steps: int = STEPS,
    accumulate: int = 1,
    clip: Optional[str] = None,
    separate_setup: bool = False,
    model: str = "gpt",
    meta_init: bool = False,
    precision: str = "32-true",
    compile_model: bool = False,
    backend: str = "aot_eager",
    accelerator: str = "cpu",
    num_nodes: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Train a test model with a plain Fabric loop; the losses, the clipped norms, the full weights
    after it (and under compile, the graphs captured after each step and the recompilations)."""
    from recompiles import RecompileCounter
    from torch._dynamo.utils import counters

    fabric = fabric_for(strategy, precision, accelerator, num_nodes, **options)
    fabric.seed_everything(0)
    make = tied_mlp if model == "mlp" else small_gpt
    if meta_init:
        with fabric.init_module(empty_init=True):
            module = make()
        assert all(p.is_meta for p in module.parameters()), "stage 3 builds on the meta device"
    else:
        module = make()
    if compile_model:
        torch._dynamo.reset()
        counters.clear()
        module = torch.compile(module, backend=backend)
    if separate_setup:
        wrapped = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1))
    else:
        wrapped, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1))
    losses, norms, graphs = [], [], []
    batches = batches_for(ctx.rank, steps * accumulate)
    with contextlib.ExitStack() as stack:
        recompiles = stack.enter_context(RecompileCounter()) if compile_model else None
        for step in range(steps):
            for micro in range(accumulate):
                batch = fabric.to_device(batches[step * accumulate + micro])
                with fabric.no_backward_sync(wrapped, enabled=micro < accumulate - 1):
                    loss = wrapped(batch[:, :-1], batch[:, 1:])[1] / accumulate
                    fabric.backward(loss)
                losses.append(loss.item())
            if clip == "norm":
                norms.append(fabric.clip_gradients(wrapped, optimizer, max_norm=0.05).item())
            elif clip == "value":
                fabric.clip_gradients(wrapped, optimizer, clip_val=1e-3)
            elif clip == "raw_norm":  # torch's own, on `.grad` (engine/gradients/sharded_grad.py)
                norms.append(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm=0.05).item())
            optimizer.step()
            optimizer.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
    return {
        "losses": losses,
        "norms": norms,
        "weights": full_weights(fabric, wrapped),
        "graphs": graphs,
        "recompiles": recompiles.count if recompiles is not None else 0,
        "reasons": recompiles.reasons if recompiles is not None else [],
    }


def tied_mlp() -> torch.nn.Module:
    from lightning_helpers import TiedMLPStack

    return TiedMLPStack()


def assert_same(ours: list[dict], ddp: list[dict], atol: float = 0.0) -> None:
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        assert a["losses"] == pytest.approx(b["losses"], abs=atol, rel=0), f"rank {rank} losses"
        assert a["norms"] == pytest.approx(b["norms"], abs=atol, rel=0), f"rank {rank} clip norms"
        assert a["weights"].keys() == b["weights"].keys()
        for key, value in b["weights"].items():
            diff = (a["weights"][key] - value).abs().max().item()
            assert diff <= atol, f"rank {rank}: {key} differs by {diff}"

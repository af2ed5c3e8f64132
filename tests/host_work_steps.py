"""One training step of the launch-bound GPT, stepped by DDP or the engine, and its host work counted:
the helpers of ``test_host_work.py`` (CPU) and ``test_cuda_host_work.py`` (the GPU tier)."""

from __future__ import annotations

import contextlib
import gc
import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import lightning_zero.engine
from lightning_zero.bench.python_calls import count_python_calls
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.shards.host_work import HOST_WORK
from lightning_zero.models.gpt import GPT, GPTConfig

LAUNCH_BOUND = GPTConfig(n_layer=12, n_embd=64, n_head=4, block_size=32)


def stepper(stage: int, device: torch.device, precision: str, shape: GPTConfig = LAUNCH_BOUND) -> tuple[Callable[[], None], object]:
    torch.manual_seed(0)
    model = GPT(shape).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (1, 32), device=device)
    targets = torch.randint(0, 256, (1, 32), device=device)

    def forward(module: nn.Module) -> torch.Tensor:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
        with autocast:
            return module(idx, targets)[1]

    if stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model)

        def step() -> None:
            forward(ddp).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, None
    # the GPU's setting, as the benchmark's (on the CPU the default reads each gather's unit tags as
    # it lands, from host memory: a read and a check per gather a GPU run does not make)
    config = ZeroConfig(stage=stage, check_units_every_gather=False) if stage == 3 else ZeroConfig(stage=stage)
    engine = ZeroEngine(model, [optimizer], config, device=device)

    def step() -> None:
        engine.begin_step()
        forward(model).backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()

    return step, engine


def count_one_step(stage: int, device: torch.device = torch.device("cpu"), precision: str = "fp32") -> dict:
    """After 3 warm-up steps, one step of DDP (``stage`` 0) or the engine at ``stage`` (world size 1,
    a process group of one rank must exist): its Python calls, ``HostWork`` and, at stage 3, how
    many bucket gathers it made."""
    step, engine = stepper(stage, device, precision)
    for _ in range(3):
        step()
    before = HOST_WORK.snapshot()
    with count_python_calls() as calls:
        step()
    out = {"calls": calls.total, "work": HOST_WORK.since(before)}
    if engine is not None:
        units = engine.residency.units if stage == 3 else []
        # the root unit is gathered once per step, the others twice (forward, backward)
        out["bucket_gathers"] = sum(len(u.buckets) for u in units[1:]) * 2 + (len(units[0].buckets) if units else 0)
        engine.close()
    return out


ENGINE = str(Path(lightning_zero.engine.__file__).parent)


def count_engine_calls(stage: int, n_layer: int) -> tuple[int, int]:
    """After 3 warm-up steps, one step of the engine at ``stage`` (1-2) on the launch-bound GPT with
    ``n_layer`` blocks, all its parameters in one bucket: the buckets, and the Python calls the
    engine makes itself (``count_python_calls(by=...)``: neither the model's nor the optimizer's),
    leaving out those within the gradient hooks, one per parameter by torch's design (stage 2)."""
    step, engine = stepper(stage, torch.device("cpu"), "fp32", dataclasses.replace(LAUNCH_BOUND, n_layer=n_layer))
    for _ in range(3):
        step()
    hooks = {hook.__code__ for p in engine.params for hook in (p.param._post_accumulate_grad_hooks or {}).values()}
    with _no_collection(), count_python_calls(by=ENGINE, outside=hooks) as calls:
        step()
    buckets = len(engine.buckets)
    engine.close()
    return buckets, calls.total


class _Layers(nn.Module):
    """``layers`` linear layers held as attributes, not in a container: one ZeRO-3 unit."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = layers
        for i in range(layers):
            self.add_module(f"linear{i}", nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.layers):
            x = torch.tanh(getattr(self, f"linear{i}")(x))
        return x


class UnitStack(nn.Module):
    """A root layer and ``units`` units of ``layers`` linear layers each: the same units, more
    parameters per unit as ``layers`` grows."""

    def __init__(self, units: int = 4, layers: int = 2, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.units = nn.ModuleList(_Layers(layers, width) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for unit in self.units:
            x = unit(x)
        return x.square().mean()


def count_unit_engine_calls(layers: int) -> tuple[int, int]:
    """Stage 3, after 3 warm-up steps, one step of a ``UnitStack`` of 4 units with ``layers`` layers
    each: the units, and the Python calls the engine makes itself (nothing left out: once the unit
    ends are trusted, no gradient hook per parameter remains, see [Note: readiness per unit])."""
    torch.manual_seed(0)
    model = UnitStack(layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    x = torch.randn(2, 16)

    def step() -> None:
        engine.begin_step()
        model(x).backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()

    for _ in range(3):
        step()
    with _no_collection(), count_python_calls(by=ENGINE) as calls:
        step()
    units = len(engine.residency.units)
    engine.close()
    return units, calls.total


@contextlib.contextmanager
def _no_collection():
    """Cyclic garbage collection held off while counting: the finalizers a collection runs (weak
    references' callbacks in the engine's code) are not the step's calls."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()

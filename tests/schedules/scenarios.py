"""Engine runs the explorer records, on each rank of a spawned group (see [Note: the schedule explorer]).

A scenario is a plain engine loop (the engine's module docstring) over a stack of residual blocks,
each a stage-3 unit, with what varies: the stage and offload options, the optimizer, and which
blocks a rank's backward does not reach (its residual stream detached after block ``k``). ``record``
runs it twice on the rank: the reference run (the CPU as usual, collectives kept) and the recorded
run (the simulated device, the host step's threads switched by ``seed``), and returns the recording
and whether both runs ended with the same weights, bit for bit.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

BLOCKS = 6
WIDTH = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class BlockStack(nn.Module):
    """An input layer, ``blocks`` residual blocks, an output layer; ``forward(x, detach_after=k)``
    detaches the residual stream after block ``k``, so backward does not reach blocks ``0..k``."""

    def __init__(self, blocks: int = BLOCKS, width: int = WIDTH) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, detach_after: Optional[int] = None) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == detach_after:
                x = x.detach()
        return self.out(x).pow(2).mean()


@dataclass(frozen=True)
class Scenario:
    name: str
    config: dict[str, Any]
    """``ZeroConfig`` options."""
    steps: int = 2
    optimizer: str = "adamw"
    detach_after: dict[int, int] = field(default_factory=dict)
    """Rank -> the block after which that rank detaches its residual stream (every step)."""
    blocks: int = BLOCKS
    edit: Optional[str] = None
    """User code between backward and ``optimizer.step()`` (a name in ``EDITS``)."""
    dtype: torch.dtype = torch.float32
    """The weights' dtype (bf16: fp32 master chunks, and at stage 3 device copies of the chunks)."""
    plan: Optional[dict[str, Any]] = None
    """``ZeroEngine.plan_host_step`` options on every rank (None: the engine's default plan).
    ``check_contents=False`` at stages 1-2: each bucket's write-back starts on the host step's thread."""
    after_backward_on: Optional[int] = None
    """A rank told to step after backward (``plan_host_step(ahead=False)``): the ranks then send the
    same write-backs at different times."""

    def __hash__(self) -> int:
        return hash(self.name)


def _halve_gradients_through_data(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.mul_(0.5)


EDITS = {"halve gradients through .data": _halve_gradients_through_data}


def train(scenario: Scenario, rank: int, device: Any = None, **overrides: Any) -> tuple[dict[str, torch.Tensor], int]:
    """The scenario's loop on this rank (``ZeroConfig`` options ``overrides`` on top of its own);
    this rank's chunk of every weight after it, by name, and the full-gradient bytes of its largest
    bucket. ``device``: the simulated device recording the run, told where each step begins."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = BlockStack(scenario.blocks).to(scenario.dtype)
    if scenario.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    options = {**scenario.config, **overrides}
    if "nvme" in (options.get("offload_optimizer"), options.get("offload_params")):
        options["nvme_path"] = tempfile.mkdtemp(prefix=f"schedules-rank{rank}-")
    engine = ZeroEngine(model, [optimizer], ZeroConfig(**options))
    if scenario.plan is not None and options.get("overlap_host_step", True):
        engine.plan_host_step(**{**scenario.plan, **({"ahead": False} if rank == scenario.after_backward_on else {})})
    edit = EDITS[scenario.edit] if scenario.edit is not None else None
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(scenario.steps):
            if device is not None:
                device.mark(f"step {step}")
            x = torch.randn(4, WIDTH, generator=generator).to(scenario.dtype)
            engine.begin_step()
            model(x, scenario.detach_after.get(rank)).backward()
            engine.finish_backward()
            engine.end_step()
            if edit is not None:
                edit(model)
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
        chunks = engine.weight_chunks()
        return {p.name: chunks[id(p)].clone() for p in engine.params}, max(b.param_bytes for b in engine.buckets)
    finally:
        engine.close()


def record(scenario: Scenario, rank: int, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """For each host-thread seed: the recorded run's trace, whether its weights are the reference
    run's bit for bit, and how often the host threads switched. The reference run takes every
    optimizer step after backward (``overlap_host_step=False``): what stepping during backward must
    give, whatever the order of the two threads."""
    import torch.distributed as dist

    from lightning_zero.engine import device_roles
    from lightning_zero.engine.comm import streams
    from lightning_zero.engine.offload import handoffs

    from schedules.collective_log import CollectiveLog, ReferenceRun
    from schedules.host_threads import SeededThreads
    from schedules.simulated_device import SimulatedDevice

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    log = CollectiveLog()
    with streams.simulating(ReferenceRun(log)):
        overrides = {"overlap_host_step": False} if scenario.config.get("offload_optimizer") else {}
        reference, _ = train(scenario, rank, **overrides)
    recordings = []
    for seed in seeds:
        log.rewind()
        device = SimulatedDevice(rank, log)
        threads = SeededThreads(seed, device)
        with device_roles.tracking_host_tensors("cpu"), device.installed(), handoffs.scheduled(threads):
            try:
                recorded, largest_bucket = train(scenario, rank, device)
            finally:
                threads.release()
        untaken = log.untaken()
        assert not untaken, f"the recorded run issued fewer collectives than the reference run: {untaken}"
        same = reference.keys() == recorded.keys() and all(torch.equal(reference[k], recorded[k]) for k in reference)
        recordings.append({
            "trace": device.trace, "same_weights": same, "switches": threads.switches, "seed": seed,
            "largest_bucket": largest_bucket,
        })  # fmt: skip
    return recordings

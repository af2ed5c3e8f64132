"""Host work per step, counted (not timed): what a fast GPU exposes in bf16 (issue 51).

At world size 1 in one process, the launch-bound GPT (12 blocks, width 64, batch 1 x 32), after
warm-up: Python function calls per step against DDP's, and at stage 3 the hooks registered and the
storages resized per step (see [Note: host work counts] in ``engine/host_work.py``). Counts are
deterministic; no time is measured.
"""

from __future__ import annotations

import sys
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.host_work import HOST_WORK
from lightning_zero.models.gpt import GPT, GPTConfig

LAUNCH_BOUND = GPTConfig(n_layer=12, n_embd=64, n_head=4, block_size=32)


def _python_calls(step: Callable[[], None]) -> int:
    calls = 0

    def count(frame, event, arg):  # noqa: ANN001
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def _stepper(stage: int) -> tuple[Callable[[], None], object]:
    torch.manual_seed(0)
    model = GPT(LAUNCH_BOUND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (1, 32))
    targets = torch.randint(0, 256, (1, 32))
    if stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model)

        def step() -> None:
            ddp(idx, targets)[1].backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, None
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))

    def step() -> None:
        engine.begin_step()
        model(idx, targets)[1].backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()

    return step, engine


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """Per stage (0: DDP): Python calls per step and the engine's host work per step, after warm-up."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return {stage: _count_one_step(stage) for stage in (0, 1, 2, 3)}
    finally:
        dist.destroy_process_group()


def _count_one_step(stage: int) -> dict:
    step, engine = _stepper(stage)
    for _ in range(3):
        step()
    before = HOST_WORK.snapshot()
    calls = _python_calls(step)
    out = {"calls": calls, "work": HOST_WORK.since(before)}
    if engine is not None:
        units = engine.residency.units if stage == 3 else []
        # the root unit is gathered once per step, the others twice (forward, backward)
        out["bucket_gathers"] = sum(len(u.buckets) for u in units[1:]) * 2 + (len(units[0].buckets) if units else 0)
        engine.close()
    return out


def test_stage3_registers_no_hook_per_step(counts):
    assert counts[3]["work"].hook_registrations == 0


def test_stage3_resizes_each_bucket_storage_once_per_gather_and_once_per_release(counts):
    # every unit but the root is gathered twice per step (forward, backward), the root once; each
    # gather grows its buckets' storages once and each release frees them once
    work, gathers = counts[3]["work"], counts[3]["bucket_gathers"]
    assert 0 < work.storage_resizes <= 2 * gathers


@pytest.mark.parametrize("stage, bound", [(1, 2.0), (2, 2.0), (3, 3.0)])
def test_python_calls_per_step_are_bounded_by_ddps(counts, stage, bound):
    ddp, ours = counts[0]["calls"], counts[stage]["calls"]
    assert ours <= bound * ddp, f"zero{stage}: {ours} Python calls per step, DDP {ddp} ({ours / ddp:.2f}x; bound {bound}x)"

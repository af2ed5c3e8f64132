"""Host work per step, counted (not timed): what a fast GPU exposes in bf16 (issue 51).

At world size 1 in one process (its collectives issued all the same), the launch-bound GPT (12 blocks, width 64, batch 1 x 32), after
warm-up: Python function calls per step against DDP's, and at stage 3 the hooks registered and the
storages resized per step (see [Note: host work counts] in ``engine/host_work.py``). Counts are
deterministic; no time is measured.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from host_work_steps import count_one_step

from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """Per stage (0: DDP): Python calls per step and the engine's host work per step, after warm-up,
    with the collectives kept at one rank: the path users run at N >= 2, as the benchmark measures."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    os.environ[COLLECTIVES_AT_ONE_RANK] = "1"
    try:
        return {stage: count_one_step(stage) for stage in (0, 1, 2, 3)}
    finally:
        del os.environ[COLLECTIVES_AT_ONE_RANK]
        dist.destroy_process_group()


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

"""Host work per step, counted (not timed): what a fast GPU exposes in bf16 (issue 51).

At world size 1 in one process (its collectives issued all the same), the launch-bound GPT (12 blocks, width 64, batch 1 x 32), after
warm-up: Python function calls per step against DDP's, and at stage 3 the hooks registered and the
storages resized per step (see [Note: host work counts] in ``engine/shards/host_work.py``). Counts are
deterministic; no time is measured.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from host_work_steps import count_engine_calls, count_one_step, count_unit_engine_calls

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


@pytest.mark.parametrize("stage, bound", [(1, 1.3), (2, 1.3), (3, 1.8)])
def test_python_calls_per_step_are_bounded_by_ddps(counts, stage, bound):
    ddp, ours = counts[0]["calls"], counts[stage]["calls"]
    assert ours <= bound * ddp, f"zero{stage}: {ours} Python calls per step, DDP {ddp} ({ours / ddp:.2f}x; bound {bound}x)"


@pytest.fixture(scope="module")
def engine_calls(tmp_path_factory):
    """Per stage 1-2, path (the collectives kept at one rank as above, or one rank's shortcuts, as a
    one-device user runs) and number of blocks (4, 8): the buckets and the engine's own Python
    calls per step, after warm-up."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    counts = {}
    try:
        for path in ("collectives", "shortcuts"):
            if path == "collectives":
                os.environ[COLLECTIVES_AT_ONE_RANK] = "1"
            for stage in (1, 2):
                for n_layer in (4, 8):
                    counts[stage, path, n_layer] = count_engine_calls(stage, n_layer)
            os.environ.pop(COLLECTIVES_AT_ONE_RANK, None)
        return counts
    finally:
        os.environ.pop(COLLECTIVES_AT_ONE_RANK, None)
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["collectives", "shortcuts"])
@pytest.mark.parametrize("stage", [1, 2])
def test_the_engines_python_calls_per_step_do_not_grow_with_a_buckets_parameters(engine_calls, stage, path):
    """Stages 1-2: what the engine does each step costs per bucket, not per parameter (STYLE item 13):
    with twice the blocks (twice the parameters) in its one bucket, the engine makes as many Python
    calls per step. torch's per-parameter gradient hooks (stage 2) are left out."""
    (buckets, calls), (buckets_twice, calls_twice) = engine_calls[stage, path, 4], engine_calls[stage, path, 8]
    assert buckets == buckets_twice == 1
    assert 0 < calls_twice == calls, f"zero{stage} ({path}): {calls} engine calls per step with 4 blocks, {calls_twice} with 8"


@pytest.fixture(scope="module")
def unit_engine_calls(tmp_path_factory):
    """Stage 3, the collectives kept at one rank: units and the engine's own Python calls per step
    with 2 and 4 layers per unit."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    os.environ[COLLECTIVES_AT_ONE_RANK] = "1"
    try:
        return {layers: count_unit_engine_calls(layers) for layers in (2, 4)}
    finally:
        os.environ.pop(COLLECTIVES_AT_ONE_RANK, None)
        dist.destroy_process_group()


def test_stage3_makes_no_python_call_per_parameter(unit_engine_calls):
    """Stage 3: a unit's gradients are ready when its backward ends (see [Note: readiness per unit]),
    so the engine's Python calls per step do not grow with the parameters of a unit: twice the
    layers per unit, the same calls."""
    (units, calls), (units_twice, calls_twice) = unit_engine_calls[2], unit_engine_calls[4]
    assert units == units_twice == 5
    assert 0 < calls_twice == calls, f"{calls} engine calls per step with 2 layers per unit, {calls_twice} with 4"

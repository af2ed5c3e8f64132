"""GPU tier: the bf16-mixed overhead step on ``cuda:0`` (issue 51), counted as on the CPU
(``test_host_work.py``): no hook registered per step, each stage-3 bucket's storage resized once per
gather and once per release, and Python calls per step within the bounds against DDP's, in the
precision users train in. On CUDA the Python calls counted leave out the backward's hooks, which
autograd runs on a device thread the profiler cannot reach (see [Note: counting Python calls] in
``bench/python_calls.py``): the bound holds for forward and the step. Skipped without a CUDA device
(see ``cuda_tier.py``); the step times are ``scripts/overhead_gpu.sh``'s."""

from __future__ import annotations

import pytest
from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

GROUP = CaseGroup(world_size=1, start_method=START_METHOD)


@GROUP.case
def bf16_mixed_counts(ctx: RankContext) -> dict:
    from host_work_steps import count_one_step

    device = setup_rank(deterministic=False)
    return {stage: count_one_step(stage, device, "bf16-mixed") for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("cuda_host_work"))


def test_stage3_registers_no_hook_and_resizes_once_per_gather_and_release(results):
    (counts,) = results["bf16_mixed_counts"]
    assert counts[3]["work"].hook_registrations == 0
    assert 0 < counts[3]["work"].storage_resizes <= 2 * counts[3]["bucket_gathers"]


@pytest.mark.parametrize("stage, bound", [(1, 2.0), (2, 2.0), (3, 3.0)])
def test_python_calls_per_bf16_mixed_step_are_bounded_by_ddps(results, stage, bound):
    (counts,) = results["bf16_mixed_counts"]
    assert counts[stage]["calls"] <= bound * counts[0]["calls"], (counts[stage]["calls"], counts[0]["calls"])

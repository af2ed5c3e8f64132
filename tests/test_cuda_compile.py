"""GPU tier, ``torch.compile`` with inductor at stage 3 on ``cuda:0`` (world size 1): the model
inside a LightningModule trains as under compiled DDP, and its graphs settle. Its own module, and
so its own step in ``scripts/gpu_check.sh``: compiling is the tier's least predictable time.
Skipped without a CUDA device (see ``cuda_tier.py``)."""

from __future__ import annotations

import pytest

from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

COMPILE_TOLERANCE = 1e-4
"""Inductor fuses DDP's one graph and stage 3's per-unit graphs differently (see test_compile.py:
2e-5 after 4 AdamW steps on the CPU); on the GPU other kernels round differently again, so 5x that.
A wrong gradient moves a weight by about the learning rate, 1e-2, per step."""

COMPILE = CaseGroup(world_size=1, timeout=600, start_method=START_METHOD)


@COMPILE.case
def inductor_stage_3(ctx: RankContext) -> dict:
    """``test_compile.compiled_fit`` with inductor on CUDA, DDP and zero3: per-step max |difference|,
    and zero3's graphs captured after each step and recompilations."""
    from lightning_helpers import max_abs_diff
    from test_compile import compiled_fit

    setup_rank(deterministic=False)
    ddp = compiled_fit(ctx, "ddp", backend="inductor", accelerator="cuda")
    zero3 = compiled_fit(ctx, "zero3", backend="inductor", accelerator="cuda")
    diffs = [max_abs_diff(a, b) for a, b in zip(ddp["history"], zero3["history"])]
    return {"diffs": diffs, "steps": len(zero3["history"]), **{k: zero3[k] for k in ("graphs", "recompiles", "reasons")}}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> GroupResults:
    return COMPILE.run(tmp_path_factory.mktemp("cuda_compile"))


def test_inductor_at_stage_3_trains_as_inductor_ddp(compiled):
    from test_compile import STEPS as COMPILE_STEPS

    (r,) = compiled["inductor_stage_3"]
    assert r["steps"] == COMPILE_STEPS and len(r["diffs"]) == COMPILE_STEPS, r
    assert max(r["diffs"]) <= COMPILE_TOLERANCE, r["diffs"]
    assert r["graphs"][2] == r["graphs"][-1] and r["recompiles"] == 0, r["reasons"]

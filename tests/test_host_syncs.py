"""Host-device syncs made by the engine in a training step, counted as the benchmark counts them
(`lightning_zero.bench.overhead`): none in forward and backward at any stage and one per step (the
used-parameter flags of every bucket and stage 3's unit tags, read together); with
`check_units_every_gather` one per all-gather instead. Also: after warm-up the communication
buffers are reused, not allocated (`engine/comm/buffers.py`)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext

GROUP = CaseGroup(world_size=2, init_process_group=True)
STAGES = (1, 2, 3)


def host_syncs_of_a_step(ctx: RankContext, stage: int, every_gather: Optional[bool] = False) -> dict:
    """Syncs from lightning-zero's code in the third step of a 3-block GPT, split at the end of
    backward, and the number of all-gathers issued in forward and backward."""
    from lightning_zero.bench.overhead import HostSyncCounter
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    stage_3_options = {"check_units_every_gather": every_gather} if stage == 3 else {}
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, bucket_size_mb=0.01, **stage_3_options))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(ctx.rank))
    syncs = HostSyncCounter()

    def step(counting: bool) -> None:
        COLLECTIVE_STATS.reset()
        syncs.in_forward_backward, syncs.recording = True, counting
        engine.begin_step()
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
        syncs.in_forward_backward = False
        gathers_in_passes = COLLECTIVE_STATS.calls["all_gather"]
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        out["gathers_in_passes"] = gathers_in_passes

    out: dict = {"buckets": len(engine.buckets), "allocations": []}
    with syncs.installed():
        for i in range(3):
            step(counting=i == 2)
            out["allocations"].append(engine.residency.pool.allocations)
    out.update(ours=syncs.ours, in_passes=syncs.ours_forward_backward, by_call=dict(syncs.ours_by_call))
    engine.close()
    return out


for _stage in STAGES:
    # stage 3 as on a GPU: unit tags read once per step (the default where parameters are on the CPU
    # is to read them at every gather, free there)
    GROUP.case(host_syncs_of_a_step, name=f"stage{_stage}", stage=_stage)
GROUP.case(host_syncs_of_a_step, name="stage3_every_gather", stage=3, every_gather=None)  # the CPU default


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_syncs"))


@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_in_forward_or_backward_and_one_per_step(results, stage):
    for r in results[f"stage{stage}"]:
        assert r["buckets"] > 1  # several buckets, still one read
        assert r["in_passes"] == 0, r["by_call"]
        assert r["by_call"] == {"tolist in read": 1}, r["by_call"]
        if stage == 3:
            assert r["gathers_in_passes"] > 0  # the tags of every gather are in that one read


def test_checking_every_gather_syncs_once_per_gather(results):
    for r in results["stage3_every_gather"]:
        assert r["in_passes"] == r["gathers_in_passes"] > 0, r["by_call"]
        assert r["by_call"]["tolist in read"] == r["ours"]


@pytest.mark.parametrize("stage", STAGES)
def test_communication_buffers_are_reused_after_the_first_step(results, stage):
    for r in results[f"stage{stage}"]:
        first, second, third = r["allocations"]
        assert first > 0
        assert second == third == first, r["allocations"]

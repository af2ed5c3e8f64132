"""Host-device syncs made by the engine in a training step, counted as the benchmark counts them
(`lightning_zero.bench.overhead`): none in forward and backward at stages 1-2 and at most one per
step (the used-parameter flags of every bucket, read together); at stage 3 the only ones in forward
and backward are the unit-tag checks, one per all-gather (see `Bucket.start_param_gather` for why
they are not deferred)."""

from __future__ import annotations

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext

GROUP = CaseGroup(world_size=2, init_process_group=True)
STAGES = (1, 2, 3)


def host_syncs_of_a_step(ctx: RankContext, stage: int) -> dict:
    """Syncs from lightning-zero's code in the third step of a 3-block GPT, split at the end of
    backward, and the number of all-gathers issued in forward and backward."""
    from lightning_zero.bench.overhead import HostSyncCounter
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.collectives import COLLECTIVE_STATS
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, bucket_size_mb=0.01))
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

    out: dict = {"buckets": len(engine.buckets)}
    with syncs.installed():
        for i in range(3):
            step(counting=i == 2)
    out.update(ours=syncs.ours, in_passes=syncs.ours_forward_backward, by_call=dict(syncs.ours_by_call))
    engine.close()
    return out


for _stage in STAGES:
    GROUP.case(host_syncs_of_a_step, name=f"stage{_stage}", stage=_stage)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_syncs"))


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_sync_once_per_step_and_never_in_forward_or_backward(results, stage):
    for r in results[f"stage{stage}"]:
        assert r["buckets"] > 1  # several buckets, still one read
        assert r["in_passes"] == 0, r["by_call"]
        assert r["ours"] == 1, r["by_call"]


def test_stage3_syncs_in_passes_only_to_check_unit_tags(results):
    for r in results["stage3"]:
        assert r["in_passes"] == r["gathers_in_passes"] > 0, r["by_call"]
        assert set(r["by_call"]) == {"tolist in _finish_param_gather", "tolist in read"}, r["by_call"]
        assert r["by_call"]["tolist in read"] == 1  # the used flags of every bucket, together

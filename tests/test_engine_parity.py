"""Engine-level parity with torch DDP, without Lightning: same init, same data, same optimizer."""

from __future__ import annotations

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from models import OddShapes, batches
from torch import nn

STEPS = 5
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01),
}


def _train_ddp(rank: int, optimizer_name: str, unused: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = OddShapes(with_unused_branch=unused)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    opt = OPTIMIZERS[optimizer_name](ddp.parameters())
    for x, y in batches(rank, STEPS):
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_zero(rank: int, optimizer_name: str, unused: bool, stage: int, bucket_size_mb: float):
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS
    from lightning_zero.engine.gradients.sharded_grad import ShardedGradient

    torch.manual_seed(0)
    model = OddShapes(with_unused_branch=unused)
    opt = OPTIMIZERS[optimizer_name](model.parameters())
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_size_mb=bucket_size_mb))
    calls_per_step = []
    for x, y in batches(rank, STEPS):
        COLLECTIVE_STATS.reset()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        engine.finish_backward()
        # `.grad` shows a view of the shards until the step (engine/gradients/grad_window.py), never a full tensor
        full_grads_left = [n for n, p in model.named_parameters() if p.grad is not None and not isinstance(p.grad, ShardedGradient)]
        opt.step()
        engine.after_optimizer_step(opt)
        calls_per_step.append(dict(COLLECTIVE_STATS.calls))
    state_elems = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")
    engine.close()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "full_grads_left_after_backward": full_grads_left,
        "optimizer_state_elems": state_elems,
        "buckets": len(engine.buckets),
        "calls_per_step": calls_per_step,
        "unused_shard_grads": [sp.name for sp in engine.params if sp.shard.grad is not None and "unused" in sp.name],
    }


GROUP = CaseGroup(world_size=2, init_process_group=True)
ZERO_CASES: dict[str, tuple[str, bool, int, float]] = {}  # case name: (optimizer, unused, stage, bucket_size_mb)


def ddp_reference(ctx: RankContext, optimizer_name: str, unused: bool) -> None:
    """torch DDP trained alike: the weights the zero runs of this optimizer/model are compared with."""
    ctx.kept[("ddp", optimizer_name, unused)] = _train_ddp(ctx.rank, optimizer_name, unused)


def zero_parity(ctx: RankContext, optimizer_name: str, unused: bool, stage: int, bucket_size_mb: float) -> dict:
    """One engine run's weights against the DDP reference, with what it kept and communicated."""
    reference = ctx.kept[("ddp", optimizer_name, unused)]
    zero = _train_zero(ctx.rank, optimizer_name, unused, stage, bucket_size_mb)
    diff = max((zero["weights"][k] - reference[k]).abs().max().item() for k in reference)
    return dict(zero, max_abs_diff=diff)


def _run_name(optimizer_name: str, unused: bool) -> str:
    return f"{optimizer_name}_{'unused' if unused else 'all_used'}"


def _case_name(optimizer_name: str, unused: bool, stage: int, bucket_size_mb: float) -> str:
    return f"{_run_name(optimizer_name, unused)}_stage{stage}_bucket{bucket_size_mb}mb"


for _optimizer_name in OPTIMIZERS:
    for _unused in (False, True):
        GROUP.case(ddp_reference, name=f"ddp_{_run_name(_optimizer_name, _unused)}", optimizer_name=_optimizer_name, unused=_unused)
        for _stage in (1, 2):
            for _bucket_size_mb in (1e-4, 25.0):  # ~one parameter per bucket, and one bucket
                _key = (_optimizer_name, _unused, _stage, _bucket_size_mb)
                ZERO_CASES[_case_name(*_key)] = _key
                GROUP.case(zero_parity, name=_case_name(*_key), optimizer_name=_optimizer_name, unused=_unused, stage=_stage, bucket_size_mb=_bucket_size_mb)


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("engine_parity"))


def test_weights_bitwise_equal_to_ddp(parity_results):
    for case in ZERO_CASES:
        for result in parity_results[case]:
            assert result["max_abs_diff"] == 0.0, f"{case}: max |zero - ddp| = {result['max_abs_diff']}"


def test_stage2_releases_full_gradients_and_stage1_too_after_reduction(parity_results):
    for case in ZERO_CASES:
        result = parity_results[case][0]
        assert result["full_grads_left_after_backward"] == [], case


def test_optimizer_state_is_sharded(parity_results):
    model = OddShapes(with_unused_branch=False)
    total = sum(p.numel() for p in model.parameters())
    padded = sum(-(-p.numel() // 2) for p in model.parameters())
    for optimizer_name, slots in (("adamw", 2), ("sgd_momentum", 1)):
        per_rank = [r["optimizer_state_elems"] for r in parity_results[_case_name(optimizer_name, False, 2, 25.0)]]
        assert sum(per_rank) == slots * total  # every element's state lives on exactly one rank
        assert max(per_rank) <= slots * padded  # and each rank holds ~1/N of it


def test_unused_parameters_keep_no_gradient(parity_results):
    for case in ZERO_CASES:
        result = parity_results[case][0]
        assert result["unused_shard_grads"] == [], case


def test_collectives_bounded_by_buckets(parity_results):
    for case, (opt, unused, stage, bucket_mb) in ZERO_CASES.items():
        result = parity_results[case][0]
        for calls in result["calls_per_step"]:
            assert calls == {"reduce_scatter": result["buckets"], "all_gather": result["buckets"]}
        if bucket_mb == 25.0:
            assert result["buckets"] == 1

"""GPU tier, issue 59 N1 through the public API: ``engine.gathered(offload_to_cpu=True)`` between steps
lends host copies of the parameters on ``cuda:0`` and takes them back, which replaces their gradient
accumulators (a device change; ``tests/test_stale_accumulators.py`` stands in for it on the CPU with a
change of dtype). Training after it must be bitwise the run without it: before the fix the unreached
marking held the old accumulators, and every later backward reduced their buckets without their
gradients (stale gradients at one rank; with offload a RuntimeError in step 3). Skipped without a CUDA
device (see ``cuda_tier.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

SHAPE = dict(block_size=32, n_layer=4, n_head=4, n_embd=64)
STEPS = 4
VARIANTS = {"zero3": {}, "zero3_offload": {"offload_optimizer": True, "offload_params": True}}
GROUP = CaseGroup(world_size=1, start_method=START_METHOD)


def _train(options: dict, summon_at: int, device: Any = "cuda:0") -> Any:
    """``STEPS`` steps of a GPT (4 blocks, AdamW) under the engine on ``device``; before step
    ``summon_at`` (-1: never) ``engine.gathered(offload_to_cpu=True)`` is entered and left. The full
    weights after them, on the host."""
    import torch

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.models.gpt import GPT, GPTConfig

    device = torch.device(device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, unit_classes=["Block"], **options), device=device)
    tokens = torch.randint(0, 256, (STEPS, 4, SHAPE["block_size"] + 1), device=device)  # (steps, B, T + 1)
    for step in range(STEPS):
        if step == summon_at:
            with engine.gathered(offload_to_cpu=True):
                assert all(p.device.type == "cpu" for p in model.parameters())
        engine.begin_step()
        model(tokens[step, :, :-1], tokens[step, :, 1:])[1].backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    with engine.gathered(offload_to_cpu=True):
        weights = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return weights


def summon_offloaded_between_steps(ctx: RankContext, variant: str) -> dict[str, Any]:
    import torch

    setup_rank(deterministic=True)
    reference = _train(VARIANTS[variant], summon_at=-1)
    try:
        summoned = _train(VARIANTS[variant], summon_at=2)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None, "bitwise": all(torch.equal(a, b) for a, b in zip(reference, summoned))}


for _variant in VARIANTS:
    GROUP.case(summon_offloaded_between_steps, name=f"summon_offloaded_{_variant}", variant=_variant)


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("cuda_unreached"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_after_summoning_host_copies_is_bitwise_the_same(results: GroupResults, variant: str) -> None:
    (out,) = results[f"summon_offloaded_{variant}"]
    assert out["error"] is None, out["error"]
    assert out["bitwise"] is True

"""Stage 3 readiness per unit (see [Note: readiness per unit] in engine/gradients/unit_readiness.py).

Two ranks on different data, the engine against torch DDP bitwise, every step:
- the usual model (each unit's parameters used by its own modules): the unit ends are trusted after
  the first backward, the per-parameter hooks go (but the root unit's), and the weights stay DDP's;
- a parameter of a later unit read by an earlier module in every step: the engine keeps counting
  per parameter (it never trusts the unit ends), and the weights stay DDP's;
- the same read in one step only (on every rank: a read at rest is agreed on by the ranks), with a
  gradient on one rank only (the other reads it detached), after the unit ends are trusted: both
  ranks raise the same error at that backward (none hangs, none steps), and the engine learns again.
"""

from __future__ import annotations

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from torch import nn

STEPS = 6


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.reads: list[nn.Module] = []  # a later block whose weight this one reads (not a submodule)

    def forward(self, x: torch.Tensor, read_ahead: str) -> torch.Tensor:
        if read_ahead and self.reads:
            weight = self.reads[0].lin.weight[0]
            x = x * (weight.detach() if read_ahead == "detached" else weight)
        return torch.tanh(self.lin(x))


class _Net(nn.Module):
    """A root layer and three blocks (units); block 0 may read block 2's weight in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.blocks[0].reads.append(self.blocks[2])

    def forward(self, x: torch.Tensor, read_ahead: str = "") -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, read_ahead)
        return x.square().mean()


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=generator) for _ in range(STEPS)]


def _train(ctx: RankContext, read_ahead_at, zero: bool) -> dict:
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3)) if zero else None
    forward = model if zero else nn.parallel.DistributedDataParallel(model)
    history, hooks, error = [], [], None
    for step, x in enumerate(_batches(ctx.rank)):
        read_ahead = read_ahead_at(step, ctx.rank)
        if engine is not None:
            engine.begin_step()
        try:
            forward(x, read_ahead).backward()
            if engine is not None:
                engine.finish_backward()
        except RuntimeError as raised:
            error = (step, str(raised))
            hooks.append(len(engine.grad_sync._handles))
            break
        if engine is not None:
            engine.end_step()
            hooks.append(len(engine.grad_sync._handles))
        optimizer.step()
        if engine is not None:
            engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        weights = engine.full_state_dict(model) if engine is not None else model.state_dict()
        history.append({k: v.detach().clone() for k, v in weights.items()})
    if engine is not None:
        engine.close()
    return {"history": history, "hooks": hooks, "error": error}


def _never(step: int, rank: int) -> str:
    return ""


def _always(step: int, rank: int) -> str:
    return "with gradient"


def _once_on_rank_1(step: int, rank: int) -> str:
    """Step 5 reads ahead on every rank, with a gradient on rank 1 only."""
    return "" if step != 4 else "with gradient" if rank == 1 else "detached"


GROUP = CaseGroup(world_size=2, init_process_group=True, timeout=120)
for _name, _when in {"never": _never, "always": _always}.items():
    GROUP.case(_train, name=f"ddp_{_name}", read_ahead_at=_when, zero=False)
    GROUP.case(_train, name=f"zero3_{_name}", read_ahead_at=_when, zero=True)
GROUP.case(_train, name="zero3_once_on_rank_1", read_ahead_at=_once_on_rank_1, zero=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("unit_readiness"))


@pytest.mark.parametrize("when", ["never", "always"])
def test_every_step_matches_ddp_bitwise(results, when):
    for ddp, zero in zip(results[f"ddp_{when}"], results[f"zero3_{when}"]):
        assert zero["error"] is None
        assert len(zero["history"]) == len(ddp["history"]) == STEPS
        for step, (expected, got) in enumerate(zip(ddp["history"], zero["history"])):
            for name, value in expected.items():
                assert torch.equal(got[name], value), f"{when}: {name} differs from DDP's after step {step + 1}"


def test_unit_ends_replace_the_hooks_once_trusted(results):
    """After the first backward only the root unit's parameters keep a hook (the root's buckets come
    last and launch as their gradients arrive): here `inp`'s weight and bias."""
    for zero in results["zero3_never"]:
        hooks = zero["hooks"]
        assert all(h == 2 for h in hooks), f"hooks after each step: {hooks}"


def test_a_parameter_read_before_its_unit_keeps_the_hooks(results):
    params = sum(1 for _ in _Net().parameters())
    for zero in results["zero3_always"]:
        assert all(h == params for h in zero["hooks"]), f"hooks after each step: {zero['hooks']}"


def test_a_late_gradient_on_one_rank_raises_on_every_rank(results):
    rank0, rank1 = results["zero3_once_on_rank_1"]
    for r in (rank0, rank1):
        assert r["error"] is not None and r["error"][0] == 4, r["error"]
        assert "after its bucket had been reduce-scattered" in r["error"][1]
        assert "HINT" in r["error"][1]
    assert "on another rank" in rank0["error"][1]
    assert "blocks.2.lin.weight" in rank1["error"][1]
    params = sum(1 for _ in _Net().parameters())
    assert rank0["hooks"][-1] == params and rank1["hooks"][-1] == params, "the engine learns again after the error"


def test_a_second_backward_before_finish_backward_is_refused(tmp_path):
    """Trusted unit ends, one rank: a second ``backward()`` reaching only unit parameters before
    ``finish_backward()`` finds every bucket reduced already; no reduction is left to carry a vote,
    and the rank raises, naming the parameters and the fix."""
    import os

    import torch.distributed as dist

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    os.environ[COLLECTIVES_AT_ONE_RANK] = "1"
    try:
        torch.manual_seed(0)
        model = _Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
        for _ in range(2):  # the first backward learns, the second is trusted
            engine.begin_step()
            model(torch.randn(4, 8)).backward()
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
        engine.begin_step()
        model(torch.randn(4, 8)).backward()
        x = torch.randn(4, 8, requires_grad=True)
        model.blocks[1](x, "").sum().backward()  # block 1 only: no root parameter, no bucket left
        with pytest.raises(RuntimeError, match=r"blocks\.1\.lin\.weight.*second `backward\(\)`"):
            engine.finish_backward()
        engine.close()
    finally:
        os.environ.pop(COLLECTIVES_AT_ONE_RANK, None)
        dist.destroy_process_group()

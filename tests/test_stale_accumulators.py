"""Unreached-parameter marking after a parameter's gradient accumulator was replaced (issue 59, N1).

torch replaces a parameter's ``AccumulateGrad`` node when its ``.data`` is assigned a tensor of another
dtype or device. ``summon_full_params(offload_to_cpu=True)`` does that on a GPU (host copies lent, then
the device views back); a lent copy of another dtype does it on the CPU, standing in for the device
change. The engine's marking must then ask about the new nodes: before the fix every later backward
found the lent parameters "unreached" (one rank: silently dropped and stale gradients; two ranks, or
offload: a RuntimeError in step 3). A replacement the engine cannot see shows as a gradient hook of a
parameter marked in the same backward: exact where its bucket was not reduced yet, else a clear error.

One process for world size 1, one spawned group of 2 CPU ranks for world size 2.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 4
LENT_AT = 2  # full copies are lent and taken back before this step
VARIANTS = {"plain": {}, "offload": {"offload_optimizer": True, "offload_params": True}, "first_block_only": {}}
"""Engine options; ``first_block_only`` lends copies to the first block's parameters only (the first
gradient hook of a backward is then not one of theirs)."""
GROUP = CaseGroup(world_size=2, init_process_group=True)


def _blocks() -> torch.nn.Module:
    from lightning_zero.models.gpt import Block, GPTConfig

    config = GPTConfig(block_size=8, n_layer=4, n_head=2, n_embd=16)
    return torch.nn.Sequential(*[Block(config) for _ in range(4)])


def _train(
    rank: int,
    stage: int,
    lend: Optional[torch.dtype],
    options: dict,
    swap: Optional[str] = None,
    lent_prefix: str = "",
    reentrant: bool = False,
) -> list[torch.Tensor]:
    """``STEPS`` steps of four GPT blocks under the engine (SGD with momentum, each rank its own data);
    the full weights after them. ``lend``: before step ``LENT_AT``, every parameter is lent a full copy
    of that dtype and taken back (the engine's ``summon_full_params(offload_to_cpu=True)`` path), or
    those whose names start with ``lent_prefix``.
    ``swap``: before that step, the parameters whose names contain it have their ``.data`` sent to
    float64 and back behind the engine's back (stages 1-2). ``reentrant``: from that step on, the
    second block runs under reentrant activation checkpointing (a nested backward)."""
    import torch.utils.checkpoint

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = ZeroConfig(stage=stage, **({"unit_classes": ["Block"]} if stage == 3 else {}), **options)
    engine = ZeroEngine(model, [optimizer], config, device=torch.device("cpu"))
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        if step == LENT_AT and lend is not None:
            for p in (p for p in engine.params if p.name.startswith(lent_prefix)):
                p.lend_full_copy(torch.zeros(p.shape, dtype=lend))
                p.end_full_copy(writeback=False)
        if step == LENT_AT and swap is not None:
            for name, p in model.named_parameters():
                if swap in name:
                    p.data = p.data.double()
                    p.data = p.data.float()
        engine.begin_step()
        x = torch.randn(2, 8, 16, generator=data)
        for i, block in enumerate(model):
            checkpointed = reentrant and step >= LENT_AT and i == 1
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) if checkpointed else block(x)
        x.pow(2).mean().backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    with engine.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return weights


def _lent_copies(rank: int) -> dict[str, Any]:
    """For each variant: whether training after a float64 loan is bitwise the run without one (or the error)."""
    out = {}
    for variant, options in VARIANTS.items():
        reference = _train(rank, 3, None, options)
        try:
            lent = _train(rank, 3, torch.float64, options, lent_prefix="0." if variant == "first_block_only" else "")
        except RuntimeError as error:
            out[variant] = str(error)
            continue
        out[variant] = all(torch.equal(a, b) for a, b in zip(reference, lent))
    return out


def _swapped_behind_the_engine(rank: int) -> dict[str, Any]:
    """Stage 2, ``.data`` sent to float64 and back on some parameters (not the first whose gradient
    comes): in one bucket with later gradients (not reduced when its own comes: exact, bitwise the
    run without), and in buckets of one block each (the first block's reduced before its gradient
    comes: the error); and on every parameter (exact). And a block put under reentrant checkpointing
    after the marking was trusted (its gradients come from a nested backward: the error)."""
    one_bucket = {"bucket_size_mb": 1.0}
    per_block = {"bucket_size_mb": 3500 * 4 / 2**20}  # one block's parameters (3,360) per bucket
    out: dict[str, Any] = {}
    reference = _train(rank, 2, None, one_bucket)
    swapped = _train(rank, 2, None, one_bucket, swap="2.mlp.fc.weight")
    out["exact"] = all(torch.equal(a, b) for a, b in zip(reference, swapped))
    # every parameter (as `model.double().float()`): the first gradient hook's node is stale, so
    # the engine takes every node again
    out["all_exact"] = all(torch.equal(a, b) for a, b in zip(_train(rank, 2, None, per_block), _train(rank, 2, None, per_block, swap="")))
    for key, misled in {"error": {"swap": "0."}, "reentrant_error": {"reentrant": True}}.items():
        try:
            _train(rank, 2, None, per_block, **misled)
            out[key] = None
        except RuntimeError as error:
            out[key] = str(error)
    return out


@GROUP.case
def lent_copies(ctx: RankContext) -> dict[str, Any]:
    return _lent_copies(ctx.rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("stale_accumulators"))


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    return _lent_copies(0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_after_full_copies_of_another_dtype_is_bitwise_the_same_at_one_rank(one_rank: dict[str, Any], variant: str) -> None:
    assert one_rank[variant] is True


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_after_full_copies_of_another_dtype_is_bitwise_the_same_at_two_ranks(results: GroupResults, variant: str) -> None:
    for rank, out in enumerate(results["lent_copies"]):
        assert out[variant] is True, f"rank {rank}: {out[variant]}"


def _assert_swaps_handled(out: dict[str, Any], where: str) -> None:
    assert out["exact"] is True and out["all_exact"] is True, where
    error = out["error"]
    assert error is not None, f"{where}: a gradient reduced without it went unnoticed"
    assert "'0." in error and "reduced its bucket without" in error and "dtype or device" in error, f"{where}: {error}"
    assert "use_reentrant" in error and "HINT" in error, f"{where}: {error}"
    error = out["reentrant_error"]
    assert error is not None and "'1." in error and "use_reentrant" in error, f"{where}: {error}"


def test_an_accumulator_replaced_behind_the_engine_is_exact_or_raises() -> None:
    """One rank only: at two, whether a bucket was reduced before the gradient came depends on when
    gloo reports a reduction done, and a rank raising alone leaves its peer in the next collective."""
    _assert_swaps_handled(_swapped_behind_the_engine(0), "one rank")

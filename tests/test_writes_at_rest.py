"""Writes into stage-3 parameters at rest reach the chunks, as DDP's reach its replicas (see [Note:
writes at rest] in ``engine/shards/at_rest.py``): after ``fit``, Lightning's own reload of a
checkpoint outside a run (``_checkpoint_connector.restore``, as its test helper ``run_model_test``
does after saving the HPC checkpoint), ``p.copy_``, in-place edits directly and through ``p.data``,
``torch.nn.init``, ``load_state_dict``; then a second ``fit`` whose callbacks write between backward
and the optimizer step and after it. Every value read back, and every step of the second fit, is
DDP's, bitwise.

One spawned group of 2 CPU ranks; every run is compared with DDP doing the same.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import named_strategy

VARIANTS = ["zero3", "zero3_offload"]
STEPS = 3
GROUP = CaseGroup(world_size=2, timeout=300)


def _write_everything(module: torch.nn.Module) -> None:
    """Writes at rest of each kind, the same on every rank (under DDP: into each replica)."""
    m = module.model
    with torch.no_grad():
        m.hidden.weight.copy_(torch.linspace(-1.0, 1.0, m.hidden.weight.numel()).view(m.hidden.weight.shape))  # overwrites
        m.inp.weight.data.clamp_(-0.1, 0.1)  # through `.data`, reading the values (WGAN's clipping)
        m.out.bias[1] = 2.0  # part of a parameter
        m.norm.weight.mul_(1.5)  # in-place arithmetic
    torch.nn.init.constant_(m.tiny, 0.75)  # torch.nn.init, which writes under no_grad itself


def _writes_in_fit() -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    class WritesInFit(Callback):
        """Between backward and the optimizer step (offloaded: while the host may have stepped
        ahead), and after the step (every parameter, through `.data`)."""

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            with torch.no_grad():
                pl_module.model.hidden.weight.mul_(0.9)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            for p in pl_module.parameters():
                p.data.clamp_(-0.5, 0.5)

    return WritesInFit()


def _writes_after_fit(ctx: RankContext, variant: str) -> dict[str, Any]:
    import lightning as L
    from lightning_helpers import RegressionModule, WeightRecorder, full_weights, make_trainer, regression_data

    L.seed_everything(0, verbose=False)
    module = RegressionModule()
    trainer = make_trainer(named_strategy(variant), STEPS)
    trainer.fit(module, regression_data(64))
    strategy = trainer.strategy
    out: dict[str, Any] = {"fitted": full_weights(module, strategy)}
    checkpoints = [os.path.join(ctx.tmpdir, f"{variant}.ckpt")]  # a sharded directory at stage 3, DDP's file
    trainer.save_checkpoint(checkpoints[0])
    if variant != "ddp":  # and one full file, as DDP's
        checkpoints.append(os.path.join(ctx.tmpdir, f"{variant}_full.ckpt"))
        strategy.state_dict_type = "full"
        trainer.save_checkpoint(checkpoints[1])
        strategy.state_dict_type = "sharded"

    _write_everything(module)
    out["written"] = full_weights(module, strategy)
    out["restored"] = []
    for path in checkpoints:  # Lightning's reload outside a run, after writes it undoes
        module.model.hidden.weight.data = torch.zeros_like(module.model.hidden.weight)
        trainer._checkpoint_connector.restore(path)
        out["restored"].append(full_weights(module, strategy))
    target = {k: v * 0.5 + 0.25 for k, v in out["fitted"].items()}
    module.load_state_dict(target)
    out["loaded"], out["target"] = full_weights(module, strategy), target

    L.seed_everything(1, verbose=False)
    recorder = WeightRecorder()
    make_trainer(named_strategy(variant), STEPS, callbacks=[_writes_in_fit(), recorder]).fit(module, regression_data(64))
    out["second_fit"] = recorder.history
    return out


@GROUP.case
def writes_after_fit(ctx: RankContext) -> dict[str, Any]:
    return {variant: _writes_after_fit(ctx, variant) for variant in ["ddp", *VARIANTS]}


@GROUP.case
def a_write_on_one_rank_only(ctx: RankContext) -> dict[str, Any]:
    """A stage-3 engine whose accesses at rest wait 3 s for the other ranks: rank 0 writes a weight
    alone (under DDP its replica would silently differ from the others'), then the other rank writes
    one, pairing with the write rank 0 abandoned; then both write, and that write holds."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm import collectives
    from models import OddShapes

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the rank's environment names the others
    torch.manual_seed(0)
    model = OddShapes()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3), timeout=timedelta(seconds=3))
    weight = model.hidden.weight
    out: dict[str, Any] = {}

    def attempt(key: str) -> None:
        try:
            with torch.no_grad():
                weight.copy_(torch.ones(weight.shape))
            out[key] = None
        except RuntimeError as error:
            out[key] = str(error)

    if ctx.rank == 0:
        attempt("alone")
    collectives.all_reduce(torch.zeros(1), None)  # the other rank waits here until rank 0 gave up
    if ctx.rank != 0:
        attempt("alone")
    attempt("together")
    out["value"] = weight.clone()
    engine.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("writes_at_rest"))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", VARIANTS)
def test_writes_at_rest_after_fit_and_between_steps_are_ddps(results: GroupResults, variant: str) -> None:
    for rank, runs in enumerate(results["writes_after_fit"]):
        ddp, ours = runs["ddp"], runs[variant]
        assert _equal(ours["fitted"], ddp["fitted"]), f"rank {rank}"
        # what each write wrote, read back gathered
        assert _equal(ours["written"], ddp["written"]) and not _equal(ours["written"], ours["fitted"]), f"rank {rank}"
        # the checkpoints reloaded outside a run hold the weights saved (every kind of them)
        assert len(ours["restored"]) == 2
        for restored in ours["restored"]:
            assert _equal(restored, ours["fitted"]) and _equal(restored, ddp["restored"][0]), f"rank {rank}"
        assert _equal(ours["loaded"], ours["target"]) and _equal(ours["loaded"], ddp["loaded"]), f"rank {rank}"
        # the second fit starts from what was written, and its own writes land as DDP's, step by step
        assert len(ours["second_fit"]) == len(ddp["second_fit"]) == STEPS
        for step, (a, b) in enumerate(zip(ours["second_fit"], ddp["second_fit"])):
            assert _equal(a, b), f"rank {rank}, step {step}"


def test_a_write_at_rest_keeps_the_master_copy_of_a_half_precision_parameter() -> None:
    """One process, bf16 weights at stage 3 (fp32 master chunks): what is written is what the
    optimizer steps from and what a gather brings back."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
    value = torch.linspace(-2.0, 2.0, 16, dtype=torch.float64).view(4, 4)  # cast by copy_, as torch casts it
    with torch.no_grad():
        model[1].weight.copy_(value)
        model[0].bias.mul_(3)
        expected_bias = (model[0].bias.clone() * 1).float()
    master = {id(p.param): p.shard for p in engine.params}
    assert master[id(model[1].weight)].dtype == torch.float32
    assert torch.equal(master[id(model[1].weight)].view(4, 4), value.to(torch.bfloat16).float())
    assert torch.equal(master[id(model[0].bias)], expected_bias)
    with engine.gathered():
        assert torch.equal(model[1].weight, value.to(torch.bfloat16))
    engine.close()


def test_a_write_at_rest_on_one_rank_only_fails_on_each_rank_that_made_it(results: GroupResults) -> None:
    rank0, rank1 = results["a_write_on_one_rank_only"]
    assert "'hidden.weight' was written at rest" in rank0["alone"] and "did not write it" in rank0["alone"], rank0
    assert "'hidden.weight' was written at rest" in rank1["alone"] and "stopped waiting" in rank1["alone"], rank1
    for r in (rank0, rank1):
        assert r["together"] is None and torch.equal(r["value"], torch.ones(13, 13))

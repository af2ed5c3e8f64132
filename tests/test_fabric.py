"""Fabric under every stage, compared with Fabric's own DDP doing the same loop: parity with
accumulation (``no_backward_sync``) and clipping (by norm and by value), ``setup_module`` +
``setup_optimizers``, meta-device init, every precision (``torch.compile``: test_compile.py), evaluation forwards
(uneven ones joined), save/load round trips with exact resume, and checkpoints that cross between
Fabric and the Trainer at another world size."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext, error_of
from fabric_loop import assert_same, batches_for, fabric_for, full_weights, small_gpt, train

STAGES = (1, 2, 3)
GROUP = CaseGroup(world_size=2)


FLOWS = {
    "plain": {},
    "accumulate": dict(accumulate=2),
    "clip_norm": dict(clip="norm"),
    "clip_value_separate_setup": dict(clip="value", separate_setup=True),
}
for _flow, _settings in FLOWS.items():
    for _strategy in ("ddp", *(f"zero{s}" for s in STAGES)):
        GROUP.case(name=f"{_flow}_{_strategy}", fn=train, strategy=_strategy, **_settings)

# torch's clipping on `param.grad` after accumulated micro-batches, at the stage with units at rest
for _strategy in ("ddp", "zero3"):
    GROUP.case(name=f"raw_clip_{_strategy}", fn=train, strategy=_strategy, accumulate=2, clip="raw_norm", steps=3)

# a meta-device build, materialized unit by unit, against DDP's eager build of the same seed
GROUP.case(name="eager_mlp_ddp", fn=train, strategy="ddp", model="mlp")
GROUP.case(name="meta_init_mlp_zero3", fn=train, strategy="zero3", model="mlp", meta_init=True)

PRECISIONS = ("bf16-mixed", "bf16-true", "64-true")
for _precision in PRECISIONS:
    for _strategy in ("ddp", "zero2", "zero3"):
        GROUP.case(name=f"{_precision}_{_strategy}", fn=train, strategy=_strategy, precision=_precision, steps=3)

# torch.compile under Fabric: in test_compile.py's group, where the ranks have compiled already

GROUP.case(name="offload_zero3", fn=train, strategy="zero3", offload_optimizer=True, offload_params=True, fused_host_step=False)


# ---- checkpoints ---------------------------------------------------------------------------------
def _adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _step(fabric: Any, model: Any, optimizer: Any, batch: torch.Tensor) -> float:
    loss = model(batch[:, :-1], batch[:, 1:])[1]
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def save_and_resume(
    ctx: RankContext, save_with: str, resume_with: str, state_dict_type: str, **save_options: Any
) -> dict[str, Any]:
    """Save after 2 steps and go on for 2; then a fresh model at another stage loads the checkpoint
    and runs the same 2 steps: max |difference| of the weights, and what `load` handed back.
    ``save_options``: more options of the saving strategy (e.g. hybrid sharding's group size)."""
    path = os.path.join(ctx.tmpdir, f"fabric_{save_with}_{resume_with}_{state_dict_type}")
    batches = batches_for(ctx.rank, 4)
    fabric = fabric_for(save_with, state_dict_type=state_dict_type, **save_options)
    fabric.seed_everything(0)
    module = small_gpt()
    model, optimizer = fabric.setup(module, _adamw(module))
    for batch in batches[:2]:
        _step(fabric, model, optimizer, batch)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2, "note": "kept"})
    for batch in batches[2:]:
        _step(fabric, model, optimizer, batch)
    expected = full_weights(fabric, model)

    fabric = fabric_for(resume_with)
    fabric.seed_everything(1)  # other initial weights: the checkpoint must replace them all
    module = small_gpt()
    model, optimizer = fabric.setup(module, _adamw(module))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state)
    for batch in batches[2:]:
        _step(fabric, model, optimizer, batch)
    actual = full_weights(fabric, model)
    return {
        "diff": max((actual[k] - expected[k]).abs().max().item() for k in expected),
        "step": state["step"],
        "rest": sorted(rest),
        "is_dir": os.path.isdir(path),
    }


GROUP.case(name="resume_sharded_zero3_to_zero1", fn=save_and_resume, save_with="zero3", resume_with="zero1", state_dict_type="sharded")
GROUP.case(name="resume_full_zero2_to_zero3", fn=save_and_resume, save_with="zero2", resume_with="zero3", state_dict_type="full")


def _gpt_module():
    from lightning_helpers import GPTModule

    return GPTModule()


@GROUP.case
def trainer_checkpoint_into_fabric(ctx: RankContext) -> dict[str, Any]:
    """The Trainer (zero3) saves a sharded checkpoint; Fabric (zero2) loads it into the same
    LightningModule: weights and optimizer state against the checkpoint converted to one file."""
    from lightning_helpers import fit_gpt

    from lightning_zero import ZeroStrategy
    from lightning_zero.checkpoint import full_checkpoint

    path = os.path.join(ctx.tmpdir, "trainer_zero3")
    _, _, trainer = fit_gpt(ZeroStrategy(stage=3), max_steps=2)
    trainer.save_checkpoint(path)
    saved = full_checkpoint(path, include_optimizer=True)

    fabric = fabric_for("zero2")
    fabric.seed_everything(5)
    module = _gpt_module()
    model, optimizer = fabric.setup(module, _adamw(module))
    rest = fabric.load(path, {"model": model, "optimizer": optimizer})
    weights = fabric.strategy.get_module_state_dict(module)
    moments = fabric.strategy.get_optimizer_state(optimizer)["state"]
    saved_moments = saved["optimizer_states"][0]["state"]
    return {
        "weights_equal": all(torch.equal(weights[k], v) for k, v in saved["state_dict"].items()),
        "moments_equal": all(torch.equal(moments[i][key], saved_moments[i][key]) for i in saved_moments for key in ("exp_avg", "exp_avg_sq")),
        "global_step": rest.get("global_step"),
        "path": path,
    }


@GROUP.case
def fabric_checkpoint_for_trainer(ctx: RankContext) -> dict[str, Any]:
    """Fabric (zero3) trains the LightningModule for 2 steps and saves; the Trainer resumes it
    (in the test, on one rank). Returns the path and the weights saved."""
    path = os.path.join(ctx.tmpdir, "fabric_zero3")
    fabric = fabric_for("zero3")
    fabric.seed_everything(0)
    module = _gpt_module()
    model, optimizer = fabric.setup(module, _adamw(module))
    for batch in batches_for(ctx.rank, 2):
        _step(fabric, model, optimizer, batch)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    return {"path": path, "weights": fabric.strategy.get_module_state_dict(module)}


@GROUP.case
def raw_weights_summon_and_whole_checkpoint(ctx: RankContext) -> dict[str, Any]:
    """`fabric.load_raw` of a plain state-dict file into a zero3 model, read back inside
    `summon_full_params`; `fabric.load(path)` with no state gives the whole checkpoint, full."""
    torch.manual_seed(3)
    reference = small_gpt().state_dict()
    raw = os.path.join(ctx.tmpdir, "raw_weights.pt")
    if ctx.rank == 0:
        torch.save(reference, raw)
    fabric = fabric_for("zero3")
    fabric.barrier()
    module = small_gpt()
    model, optimizer = fabric.setup(module, _adamw(module))
    fabric.load_raw(raw, model)
    with fabric.strategy.summon_full_params(model):
        summoned = {k: v.detach().clone() for k, v in module.state_dict().items()}
    path = os.path.join(ctx.tmpdir, "whole")
    fabric.save(path, {"model": model, "optimizer": optimizer, "epoch": 7})
    whole = fabric.load(path)
    return {
        "raw_loaded": all(torch.equal(summoned[k], v) for k, v in reference.items()),
        "whole_weights": all(torch.equal(whole["state_dict"][k], v) for k, v in reference.items()),
        "whole_epoch": whole.get("epoch"),
    }


# ---- evaluation, several modules, errors -------------------------------------------------------
def evaluate_unevenly(ctx: RankContext, strategy: str) -> list[torch.Tensor]:
    """Rank 0 evaluates 3 batches, rank 1 one (no sampler padding); then both train a step and
    evaluate again: every logit."""
    fabric = fabric_for(strategy)
    fabric.seed_everything(0)
    module = small_gpt()
    model, optimizer = fabric.setup(module, _adamw(module))
    batches = batches_for(ctx.rank, 4)
    outputs = []
    with torch.no_grad():
        for batch in batches[: 3 if ctx.rank == 0 else 1]:
            outputs.append(model(batch[:, :-1])[0])
    if strategy != "ddp":
        fabric.strategy.finish_evaluation()
    _step(fabric, model, optimizer, batches[3])
    with torch.no_grad():
        outputs.append(model(batches[0][:, :-1])[0])
    return outputs


GROUP.case(name="uneven_evaluation_ddp", fn=evaluate_unevenly, strategy="ddp")
GROUP.case(name="uneven_evaluation_zero3", fn=evaluate_unevenly, strategy="zero3")


def _mlp(width_in: int, width_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width_in, 16), torch.nn.ReLU(), torch.nn.Linear(16, width_out))


def gan(ctx: RankContext, strategy: str) -> dict[str, torch.Tensor]:
    """Lightning's DCGAN loop with two modules set up separately: the discriminator's backward does
    not reach the generator (its output detached), the generator's reaches both."""
    fabric = fabric_for(strategy)
    fabric.seed_everything(0)
    generator, discriminator = _mlp(4, 8), _mlp(8, 1)
    generator, opt_g = fabric.setup(generator, torch.optim.Adam(generator.parameters(), lr=1e-2))
    discriminator, opt_d = fabric.setup(discriminator, torch.optim.Adam(discriminator.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(ctx.rank)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    for _ in range(3):
        real, noise = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        fake = generator(noise)
        d_real, d_fake = discriminator(real), discriminator(fake.detach())
        fabric.backward(bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake)))
        opt_d.step()
        opt_d.zero_grad()
        d_fake = discriminator(fake)
        fabric.backward(bce(d_fake, torch.ones_like(d_fake)))
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    weights = {}
    for name, module in (("g", generator), ("d", discriminator)):
        weights.update({f"{name}.{k}": v.float() for k, v in fabric.strategy.get_module_state_dict(module.module).items()})
    return weights


for _strategy in ("ddp", "zero2", "zero3"):
    GROUP.case(name=f"gan_{_strategy}", fn=gan, strategy=_strategy)


@GROUP.case
def errors(ctx: RankContext) -> dict[str, str]:
    """What is refused, and the message."""
    fabric = fabric_for("zero2")
    module = small_gpt()
    model = fabric.setup_module(module)
    stray = torch.nn.Linear(2, 2)
    out = {"optimizer_of_another_module": error_of(lambda: fabric.setup_optimizers(torch.optim.SGD(stray.parameters(), lr=0.1)))}
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    _step(fabric, model, optimizer, batches_for(ctx.rank, 1)[0])
    out["optimizer_after_first_step"] = error_of(lambda: fabric.setup_optimizers(torch.optim.Adam(model.parameters())))
    path = os.path.join(ctx.tmpdir, "refused")
    out["filter"] = error_of(lambda: fabric.save(path, {"model": model}, filter={"model": lambda k, v: True}))
    other = fabric.setup(small_gpt())
    out["two_modules"] = error_of(lambda: fabric.save(path, {"a": model, "b": other}))
    out["nothing_written"] = str(os.path.exists(path))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("fabric"))


# bitwise where the arithmetic is DDP's; else float rounding: the clip norm is computed from shards
# (1e-6), and stages 2-3 reduce each micro-batch's gradient where DDP reduces their sum, as the
# Trainer's accumulation does — AdamW's normalization turns that last-bit difference in small
# gradients into up to ~2e-6 in the weights after 4 steps
TOLERANCE = {"plain": 0.0, "clip_value_separate_setup": 0.0, "accumulate": 1e-5, "clip_norm": 1e-6}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("flow", list(FLOWS))
def test_parity_with_fabric_ddp(results: GroupResults, flow: str, stage: int) -> None:
    atol = 0.0 if (flow, stage) == ("accumulate", 1) else TOLERANCE[flow]  # stage 1 accumulates unreduced, as DDP
    assert_same(results[f"{flow}_zero{stage}"], results[f"{flow}_ddp"], atol)


def test_torchs_own_clipping_on_param_grad_matches_fabric_ddp(results: GroupResults) -> None:
    assert_same(results["raw_clip_zero3"], results["raw_clip_ddp"], TOLERANCE["accumulate"])


def test_meta_device_init_matches_an_eager_build(results: GroupResults) -> None:
    assert_same(results["meta_init_mlp_zero3"], results["eager_mlp_ddp"])


# bf16-true: DDP steps bf16 weights and state, we step an fp32 master copy (see test_precision_matrix)
PRECISION_TOLERANCE = {"bf16-mixed": 1e-6, "bf16-true": 2 * 3 * 2**-7, "64-true": 0.0}


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precisions_match_fabric_ddp(results: GroupResults, precision: str, stage: int) -> None:
    ours, ddp = results[f"{precision}_zero{stage}"], results[f"{precision}_ddp"]
    atol = PRECISION_TOLERANCE[precision]
    for a, b in zip(ours, ddp):
        b = {**b, "losses": [], "norms": []} if precision == "bf16-true" else b  # losses drift with the weights
        assert_same([{**a, "losses": a["losses"] if b["losses"] else []}], [b], atol)


def test_offload_matches_fabric_ddp(results: GroupResults) -> None:
    assert_same(results["offload_zero3"], results["plain_ddp"])


def test_sharded_and_full_checkpoints_resume_exactly_at_another_stage(results: GroupResults) -> None:
    for case in ("resume_sharded_zero3_to_zero1", "resume_full_zero2_to_zero3"):
        for rank in results[case]:
            assert rank["diff"] == 0.0, case
            assert rank["step"] == 2 and rank["rest"] == ["note"], case
    assert results["resume_sharded_zero3_to_zero1"][0]["is_dir"] and not results["resume_full_zero2_to_zero3"][0]["is_dir"]


def test_a_trainer_checkpoint_loads_in_fabric(results: GroupResults) -> None:
    for rank in results["trainer_checkpoint_into_fabric"]:
        assert rank["weights_equal"] and rank["moments_equal"]
        assert rank["global_step"] == 2


def _on_one_rank(rank: int, world_size: int, fabric_path: str, trainer_path: str) -> dict[str, Any]:
    """World size 1: the Trainer resumes Fabric's checkpoint, Fabric loads the Trainer's."""
    import lightning as L
    from lightning_helpers import GPTModule, make_trainer, token_data

    from lightning_zero import ZeroStrategy

    out: dict[str, Any] = {}
    L.seed_everything(9, verbose=False)
    module = GPTModule()
    make_trainer(ZeroStrategy(stage=2), 1).validate(module, token_data(4), ckpt_path=fabric_path, verbose=False)
    out["trainer_weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(ZeroStrategy(stage=1), 1)
    trainer.fit(GPTModule(), token_data(), ckpt_path=fabric_path)  # weights and AdamW state, loops from 0
    out["trainer_steps"] = trainer.global_step

    fabric = fabric_for("zero3")
    module = GPTModule()
    model, optimizer = fabric.setup(module, _adamw(module))
    fabric.load(trainer_path, {"model": model, "optimizer": optimizer}, strict=False)
    out["fabric_weights"] = fabric.strategy.get_module_state_dict(module)
    return out


def test_checkpoints_cross_between_fabric_and_trainer_at_another_world_size(results: GroupResults) -> None:
    from multiprocess import run_on_ranks

    from lightning_zero.checkpoint import full_checkpoint

    saved = results["fabric_checkpoint_for_trainer"][0]
    trainer_path = results["trainer_checkpoint_into_fabric"][0]["path"]
    (one,) = run_on_ranks(_on_one_rank, saved["path"], trainer_path, world_size=1, init_process_group=False)
    for key, value in saved["weights"].items():
        assert torch.equal(one["trainer_weights"][key], value), key
    assert one["trainer_steps"] == 1
    for key, value in full_checkpoint(trainer_path)["state_dict"].items():
        assert torch.equal(one["fabric_weights"][key], value), key


def test_load_raw_summon_and_the_whole_checkpoint(results: GroupResults) -> None:
    for rank in results["raw_weights_summon_and_whole_checkpoint"]:
        assert rank == {"raw_loaded": True, "whole_weights": True, "whole_epoch": 7}


def test_uneven_evaluation_is_joined_and_matches_ddp(results: GroupResults) -> None:
    for ours, ddp in zip(results["uneven_evaluation_zero3"], results["uneven_evaluation_ddp"]):
        assert len(ours) == len(ddp)
        for a, b in zip(ours, ddp):
            assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ("zero2", "zero3"))
def test_two_modules_gan_matches_ddp(results: GroupResults, strategy: str) -> None:
    for ours, ddp in zip(results[f"gan_{strategy}"], results["gan_ddp"]):
        for key, value in ddp.items():
            assert torch.equal(ours[key], value), key


def test_errors_name_the_problem(results: GroupResults) -> None:
    for rank in results["errors"]:
        assert "exactly one module set up with lightning-zero" in rank["optimizer_of_another_module"]
        assert "must be set up before its first forward" in rank["optimizer_after_first_step"]
        assert "take no `filter`" in rank["filter"]
        assert "holds 2 modules" in rank["two_modules"]
        assert rank["nothing_written"] == "False"


def test_registered_names_and_refused_precision(monkeypatch, tmp_path) -> None:
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.engine.config import STRATEGY_NAMES

    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))  # what zero3_offload_nvme reads
    for name, options in STRATEGY_NAMES.items():
        strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(strategy, ZeroFabricStrategy) and strategy.stage == options["stage"]

    class Custom(Precision):
        pass

    with pytest.raises(ValueError, match="does not support Fabric's Custom"):
        ZeroFabricStrategy(stage=3, precision=Custom())
    with pytest.raises(ValueError, match="stage"):
        ZeroFabricStrategy(stage=4)


def test_16_mixed_gets_a_scaler_that_decides_across_ranks() -> None:
    import warnings

    from lightning.fabric.plugins.precision import MixedPrecision

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA scaler built on a CPU machine warns
        plugin = MixedPrecision("16-mixed", "cuda", torch.amp.GradScaler("cuda", init_scale=8.0))
    assert isinstance(ZeroFabricStrategy(stage=2, precision=plugin).precision.scaler, ZeroGradScaler)
    enabled = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=8.0))
    scaler = ZeroFabricStrategy(stage=3, precision=enabled).precision.scaler
    assert isinstance(scaler, ZeroGradScaler) and scaler.get_scale() == 8.0

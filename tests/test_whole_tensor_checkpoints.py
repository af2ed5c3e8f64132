"""A whole-tensor optimizer under the Trainer (torch's Adafactor with two param groups, factored
state on the matrices): at zero3 with accumulation and clipping against Lightning's DDP, and its
sharded checkpoints resumed bitwise at another stage, resharded 2→1 and converted to DDP's
optimizer state. (Muon + AdamW, two optimizers, are compared at every stage in
``test_whole_tensor_optimizers.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from multiprocess import run_on_ranks

STEPS = 4
FIT = dict(accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
# stage 3 adds each micro-batch's reduced chunks where DDP adds first and reduces once, and clips
# by a norm summed in another order: the precision matrix's fp32 bound
TOLERANCE = 1e-6
CHECKPOINTS = "adafactor_checkpoints"

GROUP = CaseGroup(world_size=2)


def _fit(strategy, optimizer: str, max_steps: int = STEPS, **kwargs):
    from lightning_helpers import fit_and_record

    import lightning_zero  # noqa: F401

    return fit_and_record(strategy, max_steps, module_kwargs={"optimizer": optimizer}, **kwargs)


@GROUP.case
def adafactor_against_ddp(ctx: RankContext) -> float:
    """max |zero3 - DDP| over every step."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_helpers import max_abs_diff

    ddp = _fit(DDPStrategy(), "adafactor_groups", **FIT)[1]
    zero = _fit("zero3", "adafactor_groups", **FIT)[1]
    assert len(ddp) == len(zero) == STEPS * FIT["accumulate_grad_batches"]  # one record per batch
    return max(max_abs_diff(a, b) for a, b in zip(ddp, zero))


@GROUP.case
def adafactor_saved(ctx: RankContext) -> list:
    """A zero2 fit saving sharded checkpoints at steps 2 and 4: its weights after every step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, CHECKPOINTS), every_n_train_steps=2, save_top_k=-1)
    return _fit("zero2", "adafactor_groups", callbacks=[ckpt], enable_checkpointing=True)[1]


@GROUP.case
def adafactor_resumed(ctx: RankContext) -> list:
    """Resumed from the step-2 checkpoint for steps 3 and 4 at zero3 (other stage, owners alike)."""
    return _fit("zero3", "adafactor_groups", ckpt_path=os.path.join(ctx.tmpdir, CHECKPOINTS, "epoch=0-step=2.ckpt"))[1]


@GROUP.case
def adafactor_ddp_state(ctx: RankContext) -> list:
    """DDP's 2-step fit saving its checkpoint: its full optimizer states then."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, "ddp"), every_n_train_steps=2, save_top_k=-1)
    trainer = _fit(DDPStrategy(), "adafactor_groups", max_steps=2, callbacks=[ckpt], enable_checkpointing=True)[2]
    return [opt.state_dict() for opt in trainer.optimizers]


@GROUP.case
def adafactor_ddp_resumed(ctx: RankContext) -> list:
    """DDP resumed from its own step-2 checkpoint, as ``adafactor_resumed`` is (Lightning restarts the
    epoch's batches alike for both)."""
    from lightning.pytorch.strategies import DDPStrategy

    return _fit(DDPStrategy(), "adafactor_groups", ckpt_path=os.path.join(ctx.tmpdir, "ddp", "epoch=0-step=2.ckpt"))[1]


@GROUP.case
def adafactor_precisions(ctx: RankContext) -> dict:
    """bf16-mixed: max |zero2 - DDP| over every step. bf16-true: DDP steps bf16 weights with Adafactor's
    state in bf16, the owners an fp32 master copy with fp32 state, so they part by more than rounding
    (recorded, not bounded); zero2 and zero3 step the same masters the same way: max |zero2 - zero3|."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_helpers import max_abs_diff

    def most(a: list, b: list) -> float:
        assert len(a) == len(b) == STEPS
        return max(max_abs_diff(x, y) for x, y in zip(a, b))

    mixed = most(_fit(DDPStrategy(), "adafactor_groups", precision="bf16-mixed")[1], _fit("zero2", "adafactor_groups", precision="bf16-mixed")[1])
    true_ddp, true_zero2, true_zero3 = (_fit(s, "adafactor_groups", precision="bf16-true")[1] for s in (DDPStrategy(), "zero2", "zero3"))
    return {"bf16-mixed_vs_ddp": mixed, "bf16-true_zero2_vs_zero3": most(true_zero2, true_zero3), "bf16-true_vs_ddp": most(true_ddp, true_zero2)}


@GROUP.case
def schedule_free_validation(ctx: RankContext) -> dict:
    """Schedule-free AdamW switching to its averaged weights for validation (``eval()`` in the module's
    hook, as its authors recommend): zero3's and zero1's validation outputs and final optimizer
    states against DDP's."""
    from lightning.pytorch.strategies import DDPStrategy

    runs = {name: _fit_schedule_free(strategy) for name, strategy in (("ddp", DDPStrategy()), ("zero3", "zero3"), ("zero1", "zero1"))}
    outputs, states = runs["ddp"]
    diffs = {}
    for name in ("zero3", "zero1"):
        other, other_states = runs[name]
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(outputs, other)) if len(other) == len(outputs) else None
        diffs[f"{name}_state"] = max(
            (torch.as_tensor(value).float() - torch.as_tensor(other_states["state"][i][key]).float()).abs().max().item()
            for i, entry in states["state"].items() for key, value in entry.items()
        )  # fmt: skip
    return diffs


def _fit_schedule_free(strategy) -> list:
    import lightning as L
    from lightning_helpers import RegressionModule, make_trainer, regression_data
    from schedulefree import AdamWScheduleFree

    import lightning_zero  # noqa: F401

    class ScheduleFree(RegressionModule):
        def configure_optimizers(self):
            return AdamWScheduleFree(self.parameters(), lr=1e-2, warmup_steps=2)

        def on_train_epoch_start(self) -> None:
            self.optimizers().train()

        def on_validation_epoch_start(self) -> None:
            self.optimizers().eval()

        def on_validation_epoch_end(self) -> None:
            self.optimizers().train()

        def validation_step(self, batch, batch_idx) -> None:
            self.outputs.append(self(batch[0]).detach().clone())

    class FinalState(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            (opt,) = trainer.optimizers
            engine = getattr(trainer.strategy, "engine", None)
            self.state = engine.full_optimizer_state_dict(opt) if engine is not None else opt.state_dict()

    L.seed_everything(0, verbose=False)
    module, final = ScheduleFree(), FinalState()
    module.outputs = []
    trainer = make_trainer(strategy, STEPS, callbacks=[final], val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(module, regression_data(), regression_data(16))
    return module.outputs, final.state


@GROUP.case
def muon_adamw_fabric(ctx: RankContext) -> dict:
    """Fabric, Muon on the matrices and AdamW on the rest (two optimizers), clipped by norm: zero3's
    losses and weights against Fabric's DDP, and a ``fabric.save``/``fabric.load`` round trip."""
    if not hasattr(torch.optim, "Muon"):
        return {"skipped": "this torch has no torch.optim.Muon (torch >= 2.9)"}
    runs = {strategy: _fabric_muon(ctx, strategy) for strategy in ("ddp", "zero3")}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(runs["ddp"]["losses"], runs["zero3"]["losses"])),
        "weight_diff": max((runs["ddp"]["weights"][k] - runs["zero3"]["weights"][k]).abs().max().item() for k in runs["ddp"]["weights"]),
        "reloaded_diff": runs["zero3"]["reloaded_diff"],
    }


def _fabric_muon(ctx: RankContext, strategy: str) -> dict:
    from fabric_loop import batches_for, fabric_for, full_weights, small_gpt

    fabric = fabric_for(strategy)
    fabric.seed_everything(0)
    module = small_gpt()
    matrices = [p for p in module.parameters() if p.ndim == 2]
    rest = [p for p in module.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=2e-2, momentum=0.9, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    model, muon, adamw = fabric.setup(module, muon, adamw)
    losses = []
    for batch in batches_for(ctx.rank, 3):
        loss = model(batch[:, :-1], batch[:, 1:])[1]
        fabric.backward(loss)
        fabric.clip_gradients(model, muon, max_norm=0.05)
        fabric.clip_gradients(model, adamw, max_norm=0.05)
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    weights = full_weights(fabric, model)
    path = os.path.join(ctx.tmpdir, f"fabric_muon_{strategy}")
    fabric.save(path, {"model": model, "muon": muon, "adamw": adamw})
    states = [opt.state_dict() for opt in (muon, adamw)] if strategy == "ddp" else None
    fabric.load(path, {"model": model, "muon": muon, "adamw": adamw})
    reloaded = full_weights(fabric, model)
    return {
        "losses": losses, "weights": weights, "states": states,
        "reloaded_diff": max((weights[k] - reloaded[k]).abs().max().item() for k in weights),
    }  # fmt: skip


def _state_at_start(rank: int, world_size: int, source: str) -> list:
    """Resumed at world size 1: the full optimizer states before the first step."""
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.states = [trainer.strategy.engine.full_optimizer_state_dict(opt) for opt in trainer.optimizers]

    probe = Probe()
    _fit("zero2", "adafactor_groups", max_steps=3, ckpt_path=source, callbacks=[probe])  # on_train_start runs before step 3
    return probe.states


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("whole_tensor_checkpoints")


@pytest.fixture(scope="module")
def results(root) -> GroupResults:
    return GROUP.run(root)


def _assert_states_equal(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got["state"].keys() == want["state"].keys()
        for index, entries in want["state"].items():
            assert got["state"][index].keys() == entries.keys(), index
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(got["state"][index][key]).float(), torch.as_tensor(value).float()), (index, key)


def test_adafactor_at_zero3_trains_as_ddp(results):
    for diff in results["adafactor_against_ddp"]:
        assert diff <= TOLERANCE


def test_schedule_free_validates_at_ddps_weights_and_holds_ddps_state(results):
    for diffs in results["schedule_free_validation"]:
        assert diffs == {"zero3": 0.0, "zero3_state": 0.0, "zero1": 0.0, "zero1_state": 0.0}, diffs


def test_whole_tensor_optimizer_in_half_precision(results):
    for diffs in results["adafactor_precisions"]:
        assert diffs["bf16-mixed_vs_ddp"] <= TOLERANCE, diffs
        assert diffs["bf16-true_zero2_vs_zero3"] == 0.0, diffs


def test_resume_is_bitwise_as_ddps(results):
    for ddp, resumed in zip(results["adafactor_ddp_resumed"], results["adafactor_resumed"]):
        assert len(resumed) == len(ddp) == 2
        for step in range(2):
            differing = [key for key, value in ddp[step].items() if not torch.equal(value, resumed[step][key])]
            assert differing == [], (step, differing)


def test_converted_state_is_ddps(results, root, tmp_path):
    from lightning_zero import convert_checkpoint

    results["adafactor_saved"]
    converted = torch.load(
        convert_checkpoint(root / CHECKPOINTS / "epoch=0-step=2.ckpt", tmp_path / "full.ckpt", include_optimizer=True), weights_only=False
    )
    _assert_states_equal(converted["optimizer_states"], results["adafactor_ddp_state"][0])


def test_reshard_2_to_1(results, root):
    results["adafactor_saved"]
    (states,) = run_on_ranks(_state_at_start, str(root / CHECKPOINTS / "epoch=0-step=2.ckpt"), world_size=1, init_process_group=False)
    _assert_states_equal(states, results["adafactor_ddp_state"][0])


def test_muon_adamw_under_fabric_trains_as_ddp_and_round_trips(results):
    for result in results["muon_adamw_fabric"]:
        if "skipped" in result:
            pytest.skip(result["skipped"])
        # the same arithmetic; only clipping's norm is summed in another order
        assert result["loss_diff"] <= TOLERANCE and result["weight_diff"] <= TOLERANCE, result
        assert result["reloaded_diff"] == 0.0

"""Things DDP allows that Lightning code does, at every stage, compared with DDP doing the same:
``param.data = new_tensor`` during training (kept, as under DDP; a new shape fails naming both), a
parameter stepped by two optimizers, a distributed optimizer refused at setup, a Trainer that
pickles after ``fit``, and a patch of Lightning's ``Strategy.backward`` that counts every backward."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import HAS_WEIGHT_AVERAGING, needs_weight_averaging

STEPS = 3
STAGES = (1, 2, 3)


def _strategy(name: str):
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    timeout = timedelta(seconds=60)  # a hang becomes an error
    if name.startswith("ddp"):
        return DDPStrategy(timeout=timeout, find_unused_parameters=name == "ddp_find_unused")
    return ZeroStrategy(stage=int(name[-1]), timeout=timeout)


# ---- param.data = new_tensor ----------------------------------------------------------------------
def _assigning_training_step(self, batch, batch_idx, in_a_block: bool = True):
    """What spike-detection and pruning callbacks do: new `.data` for a weight, here in the step:
    the root unit's `ln_f.weight` (gathered there at stage 3), and (at stages 1-2, where every
    weight is a full tensor) a block's."""
    model = self.model
    if batch_idx == 0:
        model.ln_f.weight.data = torch.zeros_like(model.ln_f.weight)
    if batch_idx == 1 and in_a_block:
        fc = model.blocks[1].mlp.fc.weight
        fc.data = torch.full_like(fc, 0.01)
    return self(batch[0][:, :-1], batch[0][:, 1:])[1]


def _resizing_training_step(self, batch, batch_idx):
    loss = self(batch[0][:, :-1], batch[0][:, 1:])[1]
    if batch_idx == 1:  # after the forward, which would refuse it itself (an embedding's backward does not read it)
        self.model.wpe.weight.data = torch.zeros(8, 16)
    return loss


def data_assignment(ctx: RankContext, strategy: str, step=_assigning_training_step, **step_options: Any) -> Any:
    """Weights after each step (or the error) of a GPT fit whose step assigns `.data`."""
    import functools

    import lightning as L
    from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    module = GPTModule()
    module.training_step = functools.partial(step, module, **step_options)
    recorder = WeightRecorder()
    try:
        make_trainer(_strategy(strategy), STEPS, callbacks=[recorder]).fit(module, token_data())
    except RuntimeError as err:
        return str(err)
    return recorder.history


GROUP = CaseGroup(world_size=2, timeout=300)
for _name in ("ddp", "zero1", "zero2"):
    GROUP.case(data_assignment, name=f"assign_{_name}", strategy=_name)
for _name in ("ddp", "zero3"):  # at stage 3 a block's weights exist only inside its forward
    GROUP.case(data_assignment, name=f"assign_root_{_name}", strategy=_name, in_a_block=False)
for _stage in STAGES:
    GROUP.case(data_assignment, name=f"resize_zero{_stage}", strategy=f"zero{_stage}", step=_resizing_training_step)


# ---- one parameter, two optimizers ----------------------------------------------------------------
class SharedLayerGAN(nn.Module):
    """A generator and a critic that share their first layer; each optimizer steps it."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(7, 7)
        self.generator = nn.Sequential(nn.Tanh(), nn.Linear(7, 3))
        self.critic = nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 1))


def _shared_parameter_module():
    import lightning as L

    class SharedParameterGAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = SharedLayerGAN()

        def training_step(self, batch, batch_idx) -> None:
            x, y = batch
            net = self.net
            opt_g, opt_c = self.optimizers()
            self.toggle_optimizer(opt_g)  # the shared layer stays trainable: both optimizers hold it
            fake = net.generator(net.shared(x))
            self.manual_backward(nn.functional.mse_loss(fake, y) - net.critic(fake).mean())
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_c)
            loss_c = net.critic(net.generator(net.shared(x)).detach()).mean() + net.shared(x).pow(2).mean()
            self.manual_backward(loss_c)
            opt_c.step()
            opt_c.zero_grad()
            self.untoggle_optimizer(opt_c)

        def configure_optimizers(self):
            net = self.net
            generator = [*net.shared.parameters(), *net.generator.parameters()]
            critic = [*net.shared.parameters(), *net.critic.parameters()]
            return torch.optim.AdamW(generator, lr=1e-2), torch.optim.SGD(critic, lr=1e-2, momentum=0.9)

    return SharedParameterGAN()


def shared_parameter(ctx: RankContext, strategy: str) -> list:
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer, regression_data

    L.seed_everything(0, verbose=False)
    recorder = WeightRecorder()
    make_trainer(_strategy(strategy), STEPS, callbacks=[recorder]).fit(_shared_parameter_module(), regression_data())
    return recorder.history


for _name in ("ddp_find_unused", *(f"zero{s}" for s in STAGES)):
    GROUP.case(shared_parameter, name=f"shared_{_name}", strategy=_name)


# ---- Lightning's SpikeDetection ---------------------------------------------------------------------
def _spiking_training_step(self, batch, batch_idx):
    """The GPT's loss, a thousand times larger at batch 4 on rank 1 only."""
    loss = self(batch[0][:, :-1], batch[0][:, 1:])[1]
    return loss * 1000 if batch_idx == 4 and self.trainer.global_rank == 1 else loss


def spike_detection(ctx: RankContext, strategy: str) -> dict:
    """Where SpikeDetection stops the fit (on every rank: the verdict is reduced), the batches it
    excluded, and the weights it left."""
    import os

    import lightning as L
    from lightning.pytorch.callbacks import SpikeDetection
    from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    module = GPTModule()
    module.training_step = _spiking_training_step.__get__(module)
    excluded = os.path.join(ctx.tmpdir, f"spikes_{strategy}")
    recorder = WeightRecorder()
    spikes = SpikeDetection(window=3, warmup=2, exclude_batches_path=excluded)
    try:
        make_trainer(_strategy(strategy), 8, callbacks=[recorder, spikes]).fit(module, token_data())
        stopped = None
    except Exception as err:  # noqa: BLE001 - which exception, at which batch, is what is tested
        stopped = (type(err).__name__, str(err))
    return {"stopped": stopped, "bad_batches": list(spikes.bad_batches), "history": recorder.history}


for _name in ("ddp", *(f"zero{s}" for s in STAGES)):
    GROUP.case(spike_detection, name=f"spike_{_name}", strategy=_name)


# ---- Lightning's ModelPruning --------------------------------------------------------------------------
def pruning(ctx: RankContext, strategy: str) -> Any:
    """The weights ModelPruning leaves (pruned every epoch, made permanent at the end), or the error."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelPruning
    from lightning_helpers import GPTModule, full_weights, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    module = GPTModule()
    prune = ModelPruning("l1_unstructured", amount=0.3)  # with the lottery-ticket reset, the default
    trainer = make_trainer(_strategy(strategy), 6, callbacks=[prune], max_epochs=2, limit_train_batches=3)
    try:
        trainer.fit(module, token_data())
    except RuntimeError as err:
        return str(err)
    return full_weights(module, trainer.strategy)


for _name in ("ddp", *(f"zero{s}" for s in STAGES)):
    GROUP.case(pruning, name=f"pruning_{_name}", strategy=_name)


# ---- a distributed optimizer; pickling the Trainer after fit ----------------------------------------
@GROUP.case
def distributed_optimizer(ctx: RankContext) -> Optional[str]:
    import lightning as L
    from lightning_helpers import RegressionModule, make_trainer, regression_data
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module = RegressionModule()
    module.configure_optimizers = lambda: ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    L.seed_everything(0, verbose=False)
    try:
        make_trainer(_strategy("zero2"), STEPS).fit(module, regression_data())
    except ValueError as err:
        return str(err)
    return None


@GROUP.case
def pickled_after_fit(ctx: RankContext) -> dict:
    import pickle

    from lightning_helpers import fit_and_record

    sizes = {}
    for name in ("ddp", *(f"zero{s}" for s in STAGES)):
        _, _, trainer = fit_and_record(_strategy(name), 2)
        if name == "zero3":  # the module stays sharded after fit: pickling reads each parameter (on every rank)
            import torch
            from lightning_helpers import full_weights

            loaded = pickle.loads(pickle.dumps(trainer)).strategy.lightning_module.state_dict()
            gathered = full_weights(trainer.lightning_module, trainer.strategy)
            sizes["zero3 at rest"] = loaded.keys() == gathered.keys() and all(torch.equal(loaded[k], v) for k, v in gathered.items())
            with trainer.strategy.summon_full_params():
                pickled = pickle.dumps(trainer)
        else:
            pickled = pickle.dumps(trainer)
        assert pickle.loads(pickled).strategy.__class__ is trainer.strategy.__class__
        sizes[name] = len(pickled)
    return sizes


# ---- Lightning's Strategy.backward: what a patch of it sees ------------------------------------------
@GROUP.case
def backward_through_lightning(ctx: RankContext) -> dict:
    """Lightning's own tests count backwards through a patch of ``Strategy.backward`` (the SWA
    tests); the strategy keeps Lightning's and does its part in the precision plugin's hooks. A
    plugin subclass whose ``post_backward`` skips ours fails on every rank, naming the fix."""
    from unittest import mock

    import lightning as L
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy
    from lightning_helpers import RegressionModule, make_trainer, regression_data

    from lightning_zero import ZeroStrategy
    from lightning_zero.lightning import ZeroPrecision

    out: dict[str, Any] = {}
    for name in ("ddp", *(f"zero{s}" for s in STAGES)):
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(_strategy(name), STEPS, accumulate_grad_batches=2)
        with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
            trainer.fit(RegressionModule(), regression_data())
        out[name] = backward.call_count

    class SkipsOurs(ZeroPrecision):
        def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
            return Precision.post_backward(self, tensor, module)

    try:
        make_trainer(ZeroStrategy(stage=2, precision_plugin=SkipsOurs()), STEPS).fit(RegressionModule(), regression_data())
    except RuntimeError as err:
        out["skips_ours"] = str(err)
    return out


# ---- Lightning's checkpoint flows with the default sharded directories -------------------------------
@GROUP.case
def checkpoint_flows(ctx: RankContext) -> dict:
    """ModelCheckpoint keeps the best step; `validate(ckpt_path="best")` and
    `load_from_checkpoint(best_model_path)` (a directory under zero3), DDP and zero3 alike; and
    `torch.load(checkpoint_file(best_model_path))`, what code that opens one file itself is given."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import GPTModule, fit_gpt, token_data

    from lightning_zero import checkpoint_file

    out = {}
    for name in ("ddp", "zero3"):
        best = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, f"flows_{name}"), monitor="val_loss", save_top_k=1)
        _, _, trainer = fit_gpt(_strategy(name), 4, callbacks=[best], enable_checkpointing=True, val_check_interval=2)
        validated = trainer.validate(ckpt_path="best", dataloaders=token_data(8), verbose=False)[0]["val_loss"]
        loaded = GPTModule.load_from_checkpoint(best.best_model_path, map_location="cpu")
        opened = torch.load(checkpoint_file(best.best_model_path), weights_only=False)
        out[name] = {
            "best": os.path.basename(best.best_model_path),
            "validated": validated,
            "loaded": loaded.state_dict(),
            "opened": opened["state_dict"],
            "is_directory": os.path.isdir(best.best_model_path),
        }
    return out


# ---- Lightning's weight-averaging callbacks ----------------------------------------------------------
def averaging(ctx: RankContext, strategy: str, callback: str) -> dict:
    """3 epochs of 3 steps with validation after each: EMA (updated every step, swapped in for
    validation) or SWA (from epoch 1); the weights after each step and after fit (the average)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning_helpers import fit_gpt, full_weights

    if callback == "ema":
        from lightning.pytorch.callbacks import EMAWeightAveraging

        chosen = EMAWeightAveraging()
    else:
        chosen = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1)
    module, history, trainer = fit_gpt(
        _strategy(strategy), -1, callbacks=[chosen], max_epochs=3, limit_train_batches=3, limit_val_batches=2
    )
    return {"history": history, "final": full_weights(module, trainer.strategy)}


# EMA's every step, average and final weights against DDP: tests/test_sharded_averaging.py
for _name in ("ddp", *(f"zero{s}" for s in STAGES)):
    GROUP.case(averaging, name=f"swa_{_name}", strategy=_name, callback="swa")


# ---- weight averaging and checkpoints ----------------------------------------------------------------
def averaging_resumed(ctx: RankContext, strategy: str) -> dict:
    """Lightning's EMA flow with its checkpoints (sharded directories under zeroN, by default): 2
    epochs with EMAWeightAveraging and a ModelCheckpoint keeping `last`, then a new Trainer resumes
    from it for a third. The weights after each resumed step and after fit (the average); what
    `validate(ckpt_path=last)` without the callback evaluates and `load_from_checkpoint(last)` reads
    (the average, which EMA puts in the checkpoint's `state_dict`), and the training weights its
    single-file form holds."""
    import os

    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
    from lightning_helpers import GPTModule, fit_gpt, full_weights, make_trainer, token_data

    from lightning_zero import checkpoint_file

    folder = os.path.join(ctx.tmpdir, f"ema_resume_{strategy}")
    epochs = dict(limit_train_batches=3, limit_val_batches=2)
    saving = ModelCheckpoint(dirpath=folder, save_last=True)
    fit_gpt(_strategy(strategy), -1, callbacks=[EMAWeightAveraging(), saving], enable_checkpointing=True, max_epochs=2, **epochs)
    last = os.path.join(folder, "last.ckpt")
    module, history, trainer = fit_gpt(_strategy(strategy), -1, callbacks=[EMAWeightAveraging()], ckpt_path=last, max_epochs=3, **epochs)
    validated = make_trainer(_strategy(strategy), -1).validate(GPTModule(), token_data(8), ckpt_path=last, verbose=False)
    return {
        "history": history,
        "final": full_weights(module, trainer.strategy),
        "validated": validated[0]["val_loss"],
        "loaded": GPTModule.load_from_checkpoint(last).state_dict(),
        "training_weights": torch.load(checkpoint_file(last), weights_only=False)["current_model_state"],
        "is_directory": os.path.isdir(last),
    }


def averaging_added_on_resume(ctx: RankContext, strategy: str) -> dict:
    """EMAWeightAveraging added when resuming from a checkpoint saved without it (fine-tuning): the
    callback starts its average from the checkpoint's weights, under DDP and here alike."""
    import os

    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
    from lightning_helpers import fit_gpt, full_weights

    from lightning.pytorch import Callback

    class AverageAtStart(Callback):
        """The callback's average once the checkpoint is restored (what a validation before the
        first update would evaluate): swapped into the module by the callback, read, swapped back
        (under ZeRO the average is the callback's chunks, not a module)."""

        def on_train_start(self, trainer, pl_module):
            ema._swap_models(pl_module)
            self.weights = full_weights(pl_module, trainer.strategy)
            ema._swap_models(pl_module)

    folder = os.path.join(ctx.tmpdir, f"ema_added_{strategy}")
    epochs = dict(limit_train_batches=3, limit_val_batches=2)
    fit_gpt(_strategy(strategy), -1, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], enable_checkpointing=True, max_epochs=1, **epochs)
    ema, at_start = EMAWeightAveraging(), AverageAtStart()
    module, history, trainer = fit_gpt(
        _strategy(strategy), -1, callbacks=[ema, at_start], ckpt_path=os.path.join(folder, "last.ckpt"), max_epochs=2, **epochs
    )
    return {
        "average_at_start": at_start.weights,
        "history": history,
        "final": full_weights(module, trainer.strategy),
    }


for _name in ("ddp", *(f"zero{s}" for s in STAGES)) if HAS_WEIGHT_AVERAGING else ():
    GROUP.case(averaging_resumed, name=f"ema_resumed_{_name}", strategy=_name)
    GROUP.case(averaging_added_on_resume, name=f"ema_added_{_name}", strategy=_name)


@GROUP.case
def permanent_pruning_checkpoints(ctx: RankContext) -> str:
    """ModelPruning that makes pruning permanent in checkpoints puts plain pruned weights into every
    checkpoint's `state_dict`: with a ModelCheckpoint and sharded directories the strategy refuses
    at setup (the error's message)."""
    from lightning.pytorch.callbacks import ModelPruning
    from lightning_helpers import fit_gpt

    from lightning_zero import ZeroStrategy

    try:
        fit_gpt(ZeroStrategy(stage=3), 2, callbacks=[ModelPruning("l1_unstructured", amount=0.3)], enable_checkpointing=True)
    except ValueError as err:
        return str(err)
    return "no error"


def ema_full_checkpoint(ctx: RankContext) -> bool:
    """EMAWeightAveraging's checkpoint as one file (`state_dict_type="full"`) reloads the average."""
    import os

    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lightning_helpers import GPTModule, fit_gpt, make_trainer, token_data

    from lightning_zero import ZeroStrategy

    module, _, trainer = fit_gpt(ZeroStrategy(stage=2, state_dict_type="full"), 2, callbacks=[EMAWeightAveraging()])
    path = os.path.join(ctx.tmpdir, "ema_full.ckpt")
    trainer.save_checkpoint(path)
    reloaded = GPTModule()
    make_trainer(ZeroStrategy(stage=1), 1).validate(reloaded, token_data(4), ckpt_path=path, verbose=False)
    averaged = module.state_dict()  # after fit the callback copied the average into the module
    return all(torch.equal(reloaded.state_dict()[k], v) for k, v in averaged.items())


if HAS_WEIGHT_AVERAGING:
    GROUP.case(ema_full_checkpoint)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("drop_in"))


# ---- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_assigning_param_data_keeps_the_new_values_as_under_ddp(results, stage):
    from lightning_helpers import max_abs_diff

    prefix = "assign_root" if stage == 3 else "assign"
    for ddp, zero in zip(results[f"{prefix}_ddp"], results[f"{prefix}_zero{stage}"]):
        assert not isinstance(zero, str), zero
        assert [max_abs_diff(a, b) for a, b in zip(ddp, zero)] == [0.0] * STEPS


@pytest.mark.parametrize("stage", STAGES)
def test_assigning_param_data_of_another_shape_fails_naming_both(results, stage):
    for message in results[f"resize_zero{stage}"]:
        assert isinstance(message, str), "the fit did not fail"
        assert "'model.wpe.weight' was assigned a tensor of shape (8, 16)" in message
        assert "sharded it as shape (16, 16)" in message


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_in_two_optimizers_trains_as_under_ddp(results, stage):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["shared_ddp_find_unused"], results[f"shared_zero{stage}"]):
        assert len(zero) == len(ddp) == STEPS // 2 + 1  # two optimizer steps per batch
        worst = [{k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])} for a, b in zip(ddp, zero)]
        assert worst == [{}] * len(ddp)


def test_a_distributed_optimizer_is_refused_at_setup_on_every_rank(results):
    for message in results["distributed_optimizer"]:
        assert message is not None and "ZeroRedundancyOptimizer" in message and "HINT" in message


def test_the_trainer_pickles_after_fit(results):
    for sizes in results["pickled_after_fit"]:
        assert sizes.pop("zero3 at rest") is True
        assert all(size > 0 for size in sizes.values())


def test_a_patch_of_lightnings_strategy_backward_counts_every_backward_as_under_ddp(results):
    for counts in results["backward_through_lightning"]:
        message = counts.pop("skips_ours", "")
        assert counts == {name: 2 * STEPS for name in ("ddp", "zero1", "zero2", "zero3")}  # two micro-batches a step
        assert "SkipsOurs.post_backward did not call lightning-zero's" in message and "HINT" in message


def test_lightning_checkpoint_flows_work_with_sharded_directories(results):
    from lightning_helpers import max_abs_diff

    for r in results["checkpoint_flows"]:
        assert r["zero3"]["best"] == r["ddp"]["best"]
        assert r["zero3"]["validated"] == r["ddp"]["validated"]
        assert max_abs_diff(r["ddp"]["loaded"], r["zero3"]["loaded"]) == 0.0
        assert max_abs_diff(r["ddp"]["opened"], r["zero3"]["opened"]) == 0.0
        assert r["zero3"]["is_directory"]


@pytest.mark.parametrize("stage", STAGES)
def test_spike_detection_stops_every_rank_at_the_same_batch_as_under_ddp(results, stage):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["spike_ddp"], results[f"spike_zero{stage}"]):
        assert ddp["stopped"] == ("TrainingSpikeException", "Training spike detected in batch 4")
        assert zero["stopped"] == ddp["stopped"] and zero["bad_batches"] == ddp["bad_batches"]
        assert [max_abs_diff(a, b) for a, b in zip(ddp["history"], zero["history"])] == [0.0] * len(ddp["history"])


@pytest.mark.parametrize("stage", STAGES)
def test_model_pruning_prunes_as_under_ddp(results, stage):
    # at stage 3 its hooks run with the model gathered (gathered_callbacks.py), and the lottery-ticket
    # reset's `.data` assignment becomes the storage the gathers fill, as at stages 1-2
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["pruning_ddp"], results[f"pruning_zero{stage}"]):
        assert not isinstance(zero, str), zero
        assert max_abs_diff(ddp, zero) == 0.0
        assert (zero["model.blocks.0.mlp.fc.weight"] == 0).float().mean() >= 0.3  # pruned


def test_permanent_pruning_with_sharded_checkpoints_is_refused(results):
    for message in results["permanent_pruning_checkpoints"]:
        assert "ModelPruning puts the pruned model's full weights" in message
        assert 'state_dict_type="full"' in message


@needs_weight_averaging
def test_a_full_checkpoint_file_keeps_the_ema_average(results):
    assert all(results["ema_full_checkpoint"])


@needs_weight_averaging
@pytest.mark.parametrize("stage", STAGES)
def test_ema_added_when_resuming_starts_from_the_checkpoint_as_under_ddp(results, stage):
    for ddp, zero in zip(results["ema_added_ddp"], results[f"ema_added_zero{stage}"]):
        assert all(torch.equal(ddp["average_at_start"][k], zero["average_at_start"][k]) for k in ddp["average_at_start"])
        assert len(zero["history"]) == len(ddp["history"]) == 3
        for a, b in zip(ddp["history"], zero["history"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(ddp["final"][k], zero["final"][k]) for k in ddp["final"])


@needs_weight_averaging
@pytest.mark.parametrize("stage", STAGES)
def test_ema_resumes_from_a_sharded_checkpoint_as_under_ddp(results, stage):
    for ddp, zero in zip(results["ema_resumed_ddp"], results[f"ema_resumed_zero{stage}"]):
        assert zero["is_directory"] and not ddp["is_directory"]
        assert len(zero["history"]) == len(ddp["history"]) == 3  # the resumed epoch
        for a, b in zip(ddp["history"], zero["history"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(ddp["final"][k], zero["final"][k]) for k in ddp["final"])
        assert zero["validated"] == ddp["validated"]  # the checkpoint's averaged weights
        assert all(torch.equal(ddp["loaded"][k], zero["loaded"][k]) for k in ddp["loaded"])
        # its single-file form holds the training weights where DDP's file does
        assert all(torch.equal(ddp["training_weights"][k], zero["training_weights"][k]) for k in ddp["training_weights"])


@pytest.mark.parametrize("stage", STAGES)
def test_swa_averages_as_under_ddp(results, stage):
    for ddp, zero in zip(results["swa_ddp"], results[f"swa_zero{stage}"]):
        assert len(zero["history"]) == len(ddp["history"]) == 9
        for a, b in zip(ddp["history"], zero["history"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(ddp["final"][k], zero["final"][k]) for k in ddp["final"])
        # the run ends on the average, not on the last step's weights
        assert any(not torch.equal(ddp["final"][k], ddp["history"][-1][k]) for k in ddp["final"])

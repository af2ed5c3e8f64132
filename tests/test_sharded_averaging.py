"""Lightning's weight-averaging callbacks under ZeRO keep their average as shards beside the
optimizer's (``lightning/sharded_averaging.py``, ``engine/optimizer/averaged_shards.py``), and behave as the
same callbacks under DDP, bitwise in fp32: the training weights after every step, the average
swapped in for validation, the validation losses, the weights after ``fit`` (the average), a fit
resumed from a checkpoint (sharded directory, or one file), ``validate(ckpt_path="best")`` and
``validate`` after ``fit``. At stage 3: each rank holds 4 B per parameter / N of average, as
``memory_report`` counts it, and no copy of the module exists.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import HAS_WEIGHT_AVERAGING, needs_weight_averaging

GROUP = CaseGroup(world_size=2, timeout=240)
EMA_RUNS = ("zero1", "zero2", "zero3", "zero3_offload", "zero3_full")
SWA_RUNS = ("zero1", "zero2", "zero3", "zero3_full")
EPOCHS = dict(limit_train_batches=3, limit_val_batches=2)


def _strategy(name: str):
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    timeout = timedelta(seconds=60)  # a hang becomes an error
    if name == "ddp":
        return DDPStrategy(timeout=timeout)
    # the optimizer's own kernel: the fused host step matches to rounding, not bitwise
    options = dict(offload_optimizer=True, offload_params=True, fused_host_step=False) if name.endswith("offload") else {}
    state_dict_type = "full" if name.endswith("full") else "sharded"
    return ZeroStrategy(stage=int(name[4]), timeout=timeout, state_dict_type=state_dict_type, **options)


def _recorders() -> tuple[Any, Any]:
    """Two callbacks, to list before and after the averaging one. After it: what validation sees
    (the average, swapped in), the validation losses, whether the layers existed at setup, and,
    under ZeRO, the memory report. Before it: which LightningModules were alive at setup, so that
    the copies made since (the averaging callback's) can be counted when training ends."""
    import gc

    from lightning.pytorch.callbacks import Callback
    from lightning_helpers import full_weights

    def alive(cls: type) -> set[int]:
        gc.collect()
        return {id(m) for m in gc.get_objects() if type(m) is cls}

    class BeforeSetup(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            self.alive = alive(type(pl_module))

    class Recorder(Callback):
        def __init__(self, before: BeforeSetup) -> None:
            self.before = before
            self.averages, self.losses, self.reports = [], [], []
            self.built_at_setup = self.copies = None

        def setup(self, trainer, pl_module, stage) -> None:
            if stage == "fit":
                self.built_at_setup = getattr(pl_module, "model", None) is not None

        def on_validation_epoch_start(self, trainer, pl_module) -> None:
            self.averages.append(full_weights(pl_module, trainer.strategy))

        def on_validation_end(self, trainer, pl_module) -> None:
            self.losses.append(trainer.callback_metrics["val_loss"].clone())

        def on_train_end(self, trainer, pl_module) -> None:
            if hasattr(trainer.strategy, "memory_report"):
                self.reports.append(trainer.strategy.memory_report())
            self.copies = len(alive(type(pl_module)) - self.before.alive)

    before = BeforeSetup()
    return before, Recorder(before)


def _outcome(module, history, trainer, recorder) -> dict:
    from lightning_helpers import full_weights

    return {
        "history": history,
        "final": full_weights(module, trainer.strategy),
        "averages": list(recorder.averages),
        "losses": list(recorder.losses),
        "reports": list(recorder.reports),
        "copies": recorder.copies,
        "built_at_setup": recorder.built_at_setup,
    }


# ---- EMA (and a user's WeightAveraging) on a GPT built in `configure_model` -------------------------
def _averaging_callback(kind: str):
    from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    class EveryOtherStep(WeightAveraging):
        """A user's WeightAveraging: a multi-tensor EMA, every other step, buffers not averaged."""

        def __init__(self) -> None:
            super().__init__(use_buffers=False, multi_avg_fn=get_ema_multi_avg_fn(0.8))

        def should_update(self, step_idx=None, epoch_idx=None) -> bool:
            return step_idx is not None and step_idx % 2 == 1

    return EMAWeightAveraging(decay=0.9) if kind == "ema" else EveryOtherStep()


def averaging(ctx: RankContext, strategy: str, kind: str = "ema", then: bool = True) -> dict:
    """Two epochs with a ModelCheckpoint (last, and best by val_loss); ``then`` `validate` after
    fit, `validate(ckpt_path="best")`, and a new Trainer resuming from `last` for a third epoch."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_gpt, token_data

    folder = os.path.join(ctx.tmpdir, f"{kind}_{strategy}")
    saving = ModelCheckpoint(dirpath=folder, save_last=True, monitor="val_loss", save_top_k=1)
    before, recorder = _recorders()
    gpt = dict(module_kwargs=dict(in_configure_model=True), **EPOCHS)
    callbacks = [before, _averaging_callback(kind), recorder, saving]
    module, history, trainer = fit_gpt(_strategy(strategy), -1, callbacks=callbacks, enable_checkpointing=True, max_epochs=2, **gpt)
    out = {"fit": _outcome(module, history, trainer, recorder)}
    if not then:
        return out
    out["validated_after_fit"] = trainer.validate(module, token_data(8), verbose=False)[0]["val_loss"]
    out["validated_best"] = trainer.validate(module, token_data(8), ckpt_path="best", verbose=False)[0]["val_loss"]
    out["is_directory"] = os.path.isdir(saving.last_model_path)
    before, recorder = _recorders()
    callbacks = [before, _averaging_callback(kind), recorder]
    module, history, trainer = fit_gpt(_strategy(strategy), -1, callbacks=callbacks, ckpt_path=saving.last_model_path, max_epochs=3, **gpt)
    out["resumed"] = _outcome(module, history, trainer, recorder)
    if strategy.startswith("zero"):
        engine = trainer.strategy._state_engine
        out["owned_numel"] = sum(p.owned_numel for p in engine.params)
        out["numel"] = sum(p.layout.numel for p in engine.params)
        out["padded_numel"] = sum(p.padded_chunk_numel for p in engine.params)
    return out


for _name in ("ddp", *EMA_RUNS) if HAS_WEIGHT_AVERAGING else ():
    GROUP.case(averaging, name=f"ema_{_name}", strategy=_name)
for _name in ("ddp", "zero3") if HAS_WEIGHT_AVERAGING else ():
    GROUP.case(averaging, name=f"custom_{_name}", strategy=_name, kind="custom", then=False)


# ---- SWA, with its LR schedule and its BatchNorm epoch --------------------------------------------
def _batch_norm_module():
    import lightning as L
    from torch import nn

    class WithBatchNorm(L.LightningModule):
        """An MLP with BatchNorm (SWA then recomputes its statistics in an extra epoch) and a
        parameter smaller than the world (a rank owns none of it)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Tanh(), nn.Linear(13, 3))
            self.tiny = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.model(x) * self.tiny

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=5e-2, momentum=0.9)

    return WithBatchNorm()


def swa_resume_options() -> Optional[dict]:
    """How ``Trainer.fit`` resumes the SWA run from its checkpoint: as is where torch's ``SWALR`` state
    is data; with ``weights_only=False`` where it holds its annealing function (a bound method, which
    a weights-only load refuses: torch 2.6's, torch issue #163105) and the Trainer takes the flag
    (Lightning 2.6); None where neither (Lightning 2.5 with such a torch: the strategy refuses)."""
    from torch.optim.swa_utils import SWALR

    from lightning_zero.compat.lightning_api import trainer_takes_weights_only

    state = SWALR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), swa_lr=0.01).state_dict()
    if not any(callable(value) for value in state.values()):
        return {}
    return {"weights_only": False} if trainer_takes_weights_only() else None


def swa(ctx: RankContext, strategy: str) -> dict:
    """SWA from the second of three epochs (then the BatchNorm epoch), checkpoints after each; a
    new Trainer resumes from the one after the second epoch.

    Every rank reads the same batches and nothing is validated: DDP and ZeRO sync BatchNorm's
    statistics differently (DDP broadcasts rank 0's before every forward, validation's too, and
    after SWA replaces the statistics tensors it broadcasts the old ones), and validation's
    ``zero_grad`` under ZeRO leaves the optimizer's gradient chunks, which the BatchNorm epoch's
    optimizer step (backward skipped) then applies; neither is about the average."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
    from lightning_helpers import WeightRecorder, make_trainer, regression_data

    def fit(max_epochs: int, ckpt_path=None, saving=None, **fit_options: Any) -> dict:
        L.seed_everything(0, verbose=False)
        module, (before, recorder), steps = _batch_norm_module(), _recorders(), WeightRecorder()
        callbacks = [before, StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2, annealing_epochs=1), recorder, steps]
        trainer = make_trainer(
            _strategy(strategy), -1, callbacks=callbacks + ([saving] if saving else []), max_epochs=max_epochs,
            enable_checkpointing=saving is not None, limit_train_batches=3, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module, regression_data(24), ckpt_path=ckpt_path, **fit_options)
        return _outcome(module, steps.history, trainer, recorder)

    from lightning_zero import checkpoint_file

    saving = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, f"swa_{strategy}"), every_n_epochs=1, save_top_k=-1)
    out = {"fit": fit(3, saving=saving)}
    second = os.path.join(saving.dirpath, sorted(p for p in os.listdir(saving.dirpath) if p.startswith("epoch=1"))[0])
    resume = swa_resume_options()
    if resume is not None:
        out["resumed"] = fit(3, ckpt_path=second, **resume)
    elif strategy != "ddp":  # Lightning 2.5 reads DDP's file unrestricted; the strategy refuses
        from lightning_zero.checkpoint import UntrustedCheckpointError

        try:
            fit(3, ckpt_path=second)
            out["refused"] = None
        except UntrustedCheckpointError as err:
            out["refused"] = str(err)
    # the average as one file holds it (a sharded directory's single-file form, under ZeRO)
    saved = torch.load(checkpoint_file(second, weights_only=False), weights_only=False)["callbacks"]["StochasticWeightAveraging"]
    out["saved_average"] = {k: v for k, v in saved["average_model_state"].items() if "running" not in k and "batches" not in k}
    return out


for _name in ("ddp", *SWA_RUNS):
    GROUP.case(swa, name=f"swa_{_name}", strategy=_name)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("sharded_averaging"))


# ---- the tests -------------------------------------------------------------------------------------
def _assert_equal_runs(ddp: dict, zero: dict) -> None:
    assert len(ddp["history"]) > 0
    for key in ("history", "averages"):
        assert len(zero[key]) == len(ddp[key]), key
        for step, (a, b) in enumerate(zip(ddp[key], zero[key])):
            assert all(torch.equal(a[k], b[k]) for k in a), f"{key} differ at {step}"
    assert all(torch.equal(ddp["final"][k], zero["final"][k]) for k in ddp["final"])
    assert [loss.item() for loss in zero["losses"]] == [loss.item() for loss in ddp["losses"]]


@needs_weight_averaging
@pytest.mark.parametrize("strategy", EMA_RUNS)
def test_ema_averages_validates_and_resumes_as_under_ddp(results, strategy):
    for ddp, zero in zip(results["ema_ddp"], results[f"ema_{strategy}"]):
        _assert_equal_runs(ddp["fit"], zero["fit"])
        _assert_equal_runs(ddp["resumed"], zero["resumed"])
        assert len(ddp["fit"]["averages"]) == 3 and len(ddp["resumed"]["averages"]) == 2  # sanity check, each epoch
        assert zero["validated_after_fit"] == ddp["validated_after_fit"]
        assert zero["validated_best"] == ddp["validated_best"]
        assert zero["is_directory"] == (strategy != "zero3_full")
        # the run ends on the average, and validation saw it, not the training weights
        assert any(not torch.equal(ddp["fit"]["final"][k], v) for k, v in ddp["fit"]["history"][-1].items())
        assert any(not torch.equal(ddp["fit"]["averages"][-1][k], v) for k, v in ddp["fit"]["history"][-1].items())


@needs_weight_averaging
def test_a_users_weight_averaging_with_its_own_function_and_schedule_runs_as_under_ddp(results):
    for ddp, zero in zip(results["custom_ddp"], results["custom_zero3"]):
        _assert_equal_runs(ddp["fit"], zero["fit"])
        assert len(ddp["fit"]["averages"]) == 3  # sanity check, each epoch


@pytest.mark.parametrize("strategy", SWA_RUNS)
def test_swa_with_batch_norm_averages_as_under_ddp(results, strategy):
    for ddp, zero in zip(results["swa_ddp"], results[f"swa_{strategy}"]):
        _assert_equal_runs(ddp["fit"], zero["fit"])
        assert ddp["fit"]["copies"] == 1 and zero["fit"]["copies"] == 0
        assert ddp["saved_average"].keys() == zero["saved_average"].keys()
        assert all(torch.equal(v, zero["saved_average"][k]) for k, v in ddp["saved_average"].items())
        # the average was copied in, and the BatchNorm epoch recomputed the statistics from it
        last_swa_step = ddp["fit"]["history"][3 * 3 - 1]
        assert not torch.equal(ddp["fit"]["final"]["model.0.weight"], last_swa_step["model.0.weight"])
        assert not torch.equal(ddp["fit"]["final"]["model.1.running_mean"], last_swa_step["model.1.running_mean"])


@pytest.mark.skipif(
    swa_resume_options() is None,
    reason="this torch's SWALR state holds a function, which only `Trainer.fit(weights_only=False)` reads (Lightning 2.6.0 and newer)",
)
@pytest.mark.parametrize("strategy", SWA_RUNS)
def test_swa_resumes_as_under_ddp(results, strategy):
    for ddp, zero in zip(results["swa_ddp"], results[f"swa_{strategy}"]):
        _assert_equal_runs(ddp["resumed"], zero["resumed"])
        assert zero["resumed"]["copies"] == 0


@pytest.mark.skipif(swa_resume_options() is not None, reason="the Trainer can resume from this SWA checkpoint")
@pytest.mark.parametrize("strategy", [s for s in SWA_RUNS if not s.endswith("full")])
def test_swa_resume_that_lightning_cannot_trust_is_refused_naming_the_lightning_needed(results, strategy):
    for zero in results[f"swa_{strategy}"]:
        assert zero["refused"] is not None and "is not safe to load" in zero["refused"], zero["refused"]
        assert "from Lightning 2.6.0" in zero["refused"]


@needs_weight_averaging
@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_ema_at_stage_3_holds_4_bytes_per_parameter_over_n_per_rank(results, strategy):
    runs = results[f"ema_{strategy}"]
    n = len(runs)
    for run in runs:
        report = run["resumed"]["reports"][0]
        # fp32, no buffers: 4 B for each element this rank owns, at most ceil(numel / N) of each parameter
        assert report.averages == 4 * run["owned_numel"] <= 4 * run["padded_numel"] < 4 * run["numel"] / n + 4 * 64
        place = report.host if strategy.endswith("offload") else report.device
        assert place.averages == report.averages  # beside the master chunks
    # the ranks' chunks are the whole average, each element once
    assert sum(run["resumed"]["reports"][0].averages for run in runs) == 4 * runs[0]["numel"]


@needs_weight_averaging
def test_no_rank_holds_a_copy_of_the_module_and_setup_builds_no_layers(results):
    for ddp, zero in zip(results["ema_ddp"], results["ema_zero3"]):
        assert ddp["fit"]["copies"] == 1  # the AveragedModel's copy of the LightningModule
        assert zero["fit"]["copies"] == zero["resumed"]["copies"] == 0
        # Lightning's setup calls `configure_model` to copy the layers; under ZeRO-3 they are first
        # built (on the meta device) by the strategy, after the callbacks' setup
        assert ddp["fit"]["built_at_setup"] and not zero["fit"]["built_at_setup"]


@needs_weight_averaging
def test_a_subclass_override_still_runs_and_its_super_reaches_the_sharded_method():
    import pickle
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    from lightning_zero.lightning.sharded_averaging import shard_weight_averaging

    calls = []

    class Counting(EMAWeightAveraging):  # as Lightning's own tests count swaps
        def _swap_models(self, pl_module):
            calls.append("override")
            return super()._swap_models(pl_module)

    ema, swa = Counting(), StochasticWeightAveraging(swa_lrs=0.1)
    trainer = SimpleNamespace(callbacks=[ema, swa])
    shard_weight_averaging(trainer)
    shard_weight_averaging(trainer)  # idempotent: every run of a Trainer calls it
    mro = [c.__name__ for c in type(ema).__mro__]
    assert mro[:5] == ["Counting", "Counting", "EMAWeightAveraging", "ShardedWeightAveraging", "WeightAveraging"]
    ema._average_model = SimpleNamespace(shards=SimpleNamespace(swap=lambda: calls.append("sharded swap")))
    ema._swap_models(None)
    assert calls == ["override", "sharded swap"]
    # a pickled or copied callback is the user's class again (the next setup shards it again)
    assert type(pickle.loads(pickle.dumps(swa))) is StochasticWeightAveraging

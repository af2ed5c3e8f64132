"""The parity matrix: stage {1, 2, 3} x precision {32-true, bf16-mixed, bf16-true} x training-loop
feature, each cell against Lightning's DDP with the same settings on 2 CPU ranks; plus loss
scaling deciding inf/NaN steps across ranks."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 3
STAGES = ("zero1", "zero2", "zero3")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
FEATURES = {
    "clip_norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "accumulate_3": dict(accumulate_grad_batches=3),
    "frozen": dict(module_kwargs={"make_model": "frozen"}),
    "groups_scheduler": dict(module_kwargs={"optimizer": "two_groups_steplr"}),
    "manual_two_optimizers": dict(manual=True),
}

# fp32 cells: bitwise where the arithmetic is the same, else within 1e-6 (see below)
FP32_TOLERANCE = 1e-6
# bf16-mixed keeps fp32 weights and runs the same autocast ops as DDP, so it shares fp32's bound.
# bf16-true: DDP steps bf16 weights with bf16 optimizer state, we step an fp32 master copy and
# round once per step, so the two differ by bf16 rounding: one bf16 ulp (2^-8 relative) per
# step, over STEPS steps, on weights below ~2 in magnitude, is 2 * STEPS * 2^-7.
BF16_TRUE_TOLERANCE = 2 * STEPS * 2**-7


def _frozen():
    from models import OddShapes

    model = OddShapes()
    model.inp.requires_grad_(False)
    model.norm.requires_grad_(False)
    return model


def _reference_precision(precision: str) -> dict:
    """The Trainer's precision option for the DDP reference. bf16-mixed: autocast without torch's
    cache of cast weights, as ours runs it (see compat/lightning_api.py), which only Lightning 2.5's
    plugin keeps: with the cache a module called twice in a step reuses one bf16 copy of its weight
    and sums the two gradients in bf16 before the fp32 cast (7e-6 apart in `manual_two_optimizers`)."""
    if precision != "bf16-mixed":
        return dict(precision=precision)
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_zero.compat.lightning_api import without_weight_cache

    class WithoutWeightCache(MixedPrecision):
        def autocast_context_manager(self) -> torch.autocast:
            return without_weight_cache(super().autocast_context_manager())

    return dict(plugins=[WithoutWeightCache(precision, "cpu")])


def _run(strategy, precision: str, feature: str, reference: bool = False) -> list:
    """The weights after each step of one training-loop feature's fit (``reference``: DDP's)."""
    import lightning as L
    from lightning_helpers import TwoOptimizerModule, WeightRecorder, fit_and_record, make_trainer, regression_data

    import lightning_zero  # noqa: F401

    options = _reference_precision(precision) if reference else dict(precision=precision)
    kwargs = dict(FEATURES[feature])
    if kwargs.pop("manual", False):
        L.seed_everything(0, verbose=False)
        module, recorder = TwoOptimizerModule(), WeightRecorder()
        make_trainer(strategy, STEPS, callbacks=[recorder], **options).fit(module, regression_data())
        return recorder.history
    module_kwargs = dict(kwargs.pop("module_kwargs", {}))
    if module_kwargs.get("make_model") == "frozen":
        module_kwargs["make_model"] = _frozen
    return fit_and_record(strategy, STEPS, module_kwargs=module_kwargs, **options, **kwargs)[1]


MATRIX = CaseGroup(world_size=2)


def ddp_reference(ctx: RankContext, precision: str, feature: str) -> None:
    """Lightning's DDP with the cell's settings: the history the row's stages are compared with."""
    from lightning.pytorch.strategies import DDPStrategy

    reference = DDPStrategy(find_unused_parameters=feature in ("frozen", "manual_two_optimizers"))
    ctx.kept[("ddp", precision, feature)] = _run(reference, precision, feature, reference=True)


def matrix_cell(ctx: RankContext, stage: str, precision: str, feature: str) -> Optional[float]:
    """max |zero - ddp| over the steps of one cell (None if the step counts differ)."""
    from lightning_helpers import max_abs_diff

    ddp = ctx.kept[("ddp", precision, feature)]
    history = _run(stage, precision, feature)
    return max(max_abs_diff(a, b) for a, b in zip(ddp, history)) if len(history) == len(ddp) else None


for _precision in PRECISIONS:
    for _feature in FEATURES:
        MATRIX.case(ddp_reference, name=f"ddp_{_precision}_{_feature}", precision=_precision, feature=_feature)
        for _stage in STAGES:
            MATRIX.case(matrix_cell, name=f"{_stage}_{_precision}_{_feature}", stage=_stage, precision=_precision, feature=_feature)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> GroupResults:
    return MATRIX.run(tmp_path_factory.mktemp("precision_matrix"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("stage", STAGES)
def test_matches_ddp(matrix, stage, precision, feature):
    tolerance = BF16_TRUE_TOLERANCE if precision == "bf16-true" else FP32_TOLERANCE
    for diff in matrix[f"{stage}_{precision}_{feature}"]:
        assert diff is not None, "different number of steps"
        assert diff <= tolerance, f"max |zero - ddp| = {diff}"


SCALER = CaseGroup(world_size=2, init_process_group=True)


@SCALER.case
def scaler_skips(ctx: RankContext) -> dict:
    """Three scaled steps where only rank 1's shard overflows in the second: scales, which steps
    moved the weights, and the scaler's final state."""
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = ZeroGradScaler("cpu", init_scale=1024.0, growth_interval=1)
    out = {"scales": [], "stepped": []}
    for step in range(3):
        before = param.detach().clone()
        scaler.scale(torch.ones(()))  # what scaler.scale(loss).backward() starts with
        param.grad = torch.full((4,), 8.0)
        if step == 1 and ctx.rank == 1:
            param.grad[2] = float("inf")  # only rank 1's shard overflows
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["stepped"].append(not torch.equal(before, param.detach()))
    out["state"] = scaler.state_dict()
    return out


@pytest.fixture(scope="module")
def scaler(tmp_path_factory) -> GroupResults:
    return SCALER.run(tmp_path_factory.mktemp("scaler"))


def test_loss_scaling_skips_the_same_steps_on_every_rank(scaler):
    ranks = scaler["scaler_skips"]
    assert ranks[0]["stepped"] == ranks[1]["stepped"] == [True, False, True]
    assert ranks[0]["scales"] == ranks[1]["scales"] == [2048.0, 1024.0, 2048.0]
    assert ranks[0]["state"] == ranks[1]["state"]


def test_16_mixed_gets_the_sharded_scaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
    from lightning_zero.lightning.precision import check_precision_supported, to_zero_precision

    plugin = to_zero_precision(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0)))
    assert isinstance(plugin.scaler, ZeroGradScaler) and plugin.scaler.get_scale() == 8.0
    check_precision_supported(plugin)
    with pytest.raises(ValueError, match="ZeroGradScaler"):
        check_precision_supported(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))

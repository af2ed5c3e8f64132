"""``memory_report()`` and the estimator count frozen parameters at every stage: whole on every rank
at stages 1-2 (they are in no optimizer), one chunk per rank at stage 3 (on the host with
``offload_params``), with no gradients and no optimizer state (see [Note: frozen parameters] in
``lightning_zero.estimate``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from lora_models import IN_FEATURES, LoraStack, frozen_numel

GROUP = CaseGroup(world_size=2, init_process_group=True)
LAYOUTS = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
}


def _model() -> LoraStack:
    # every parameter's numel even: 2 ranks' chunks need no padding, which the estimator leaves out
    return LoraStack(out_features=4)


def _measure(ctx: RankContext, options: dict[str, Any]) -> dict[str, Any]:
    """One step, then a second backward: the report with gradients and optimizer state both held."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = _model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(**options))
    for step in range(2):
        engine.begin_step()
        model(torch.randn(4, IN_FEATURES)).square().mean().backward()
        engine.finish_backward()
        engine.end_step()
        if step == 1:
            break
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    report = engine.memory_report()
    engine.close()
    return dict(report=report, trainable_tensors=len(trainable))


for _name, _options in LAYOUTS.items():
    GROUP.case(_measure, name=_name, options=_options)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("frozen_memory"))


def _sizes() -> tuple[int, int]:
    model = _model()
    return sum(p.numel() for p in model.parameters()), frozen_numel(model)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_report_counts_frozen_weights(results: GroupResults, name: str) -> None:
    total, frozen = _sizes()
    n = GROUP.world_size
    for r in results[name]:
        report = r["report"]
        if name in ("zero1", "zero2"):  # whole on every rank, on the device
            assert (report.frozen_device, report.frozen_host) == (4 * frozen, 0)
            assert report.parameters == 4 * total
        elif name == "zero3":  # this rank's chunk
            assert (report.frozen_device, report.frozen_host) == (4 * frozen // n, 0)
            assert report.parameters == 4 * total // n
        else:  # offload_params, fp32: the host chunk is the only copy
            assert (report.frozen_device, report.frozen_host) == (0, 4 * frozen // n)
            assert report.host.parameters == 4 * total // n
        assert report.frozen_parameters == report.frozen_device + report.frozen_host


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimator_agrees_with_memory_report(results: GroupResults, name: str) -> None:
    from lightning_zero import ZeroStrategy
    from lightning_zero.lightning.memory_monitor import estimate_per_rank

    total, frozen = _sizes()
    predicted = estimate_per_rank(total, ZeroStrategy(**LAYOUTS[name]), "32-true", devices=GROUP.world_size, nodes=1, frozen_params=frozen)
    assert predicted is not None
    for r in results[name]:
        measured = r["report"]
        assert measured.device.parameters == predicted.device.parameters
        assert measured.host.parameters == predicted.host.parameters
        if name == "zero1":  # the estimate prices the full gradients backward holds; reduced, chunks are left
            assert measured.gradients == predicted.gradients // GROUP.world_size
        elif name == "zero3_offload":  # the host rows also hold each trainable bucket's flag columns
            from lightning_zero.engine.comm.stop_vote import StopVote

            trainable_buckets = 1 + len(_model().frozen_blocks())  # the root's head, one per adapter
            flags = r["trainable_tensors"] + trainable_buckets * StopVote.WIDTH
            assert measured.gradients == predicted.gradients + 4 * flags
        else:
            assert measured.gradients == predicted.gradients  # the trainable parameters' only
        # AdamW's moments of the trainable chunks, and its step count (4 B) per parameter tensor
        assert measured.optimizer_state - 4 * r["trainable_tensors"] == predicted.optimizer_state
        # counting the frozen weights as trained over-estimates by their gradients and moments
        as_trained = estimate_per_rank(total, ZeroStrategy(**LAYOUTS[name]), "32-true", devices=GROUP.world_size, nodes=1)
        assert as_trained.total > predicted.total


def test_estimate_prices_frozen_weights_only() -> None:
    from lightning_zero import estimate as est
    from lightning_zero.engine.config import ZeroStage
    from lightning_zero.estimate_schemes import SCHEMES, Layout

    mixed, psi, frozen, n = SCHEMES["mixed"], 8_000, 6_000, 4
    trained = psi - frozen
    by_stage = {s: est.estimate(psi, Layout(s), mixed, est.Topology(n), frozen_params=frozen).device for s in ZeroStage}
    assert by_stage[ZeroStage.NOTHING] == est.StateBytes(2 * psi, 2 * trained, 12 * trained)
    assert by_stage[ZeroStage.OPTIMIZER_STATE] == est.StateBytes(2 * psi, 2 * trained, 12 * trained // n)
    assert by_stage[ZeroStage.GRADIENTS] == est.StateBytes(2 * psi, 2 * trained // n, 12 * trained // n)
    assert by_stage[ZeroStage.PARAMETERS] == est.StateBytes(2 * psi // n, 2 * trained // n, 12 * trained // n)
    assert est.estimate(psi, Layout(ZeroStage.GRADIENTS), mixed, est.Topology(n)) == est.estimate(
        psi, Layout(ZeroStage.GRADIENTS), mixed, est.Topology(n), frozen_params=0
    )
    with pytest.raises(ValueError, match="frozen parameters must be between 0"):
        est.estimate(psi, Layout(ZeroStage.GRADIENTS), mixed, est.Topology(n), frozen_params=psi + 1)


def test_estimate_prices_kept_frozen_units_during_backward() -> None:
    from lightning_zero import estimate as est
    from lightning_zero import sizing
    from lightning_zero.engine.config import ZeroStage
    from lightning_zero.estimate_schemes import SCHEMES, Layout

    mixed, psi, frozen, topology = SCHEMES["mixed"], 8_000, 6_000, est.Topology(4)

    def kept(stage: ZeroStage, budget_mb: float) -> est.MemoryEstimate:
        return est.estimate(psi, Layout(stage), mixed, topology, frozen_params=frozen, keep_frozen_units_mb=budget_mb)

    assert kept(ZeroStage.PARAMETERS, math.inf).kept_frozen_units_per_rank == 2 * frozen  # every frozen weight, full
    assert kept(ZeroStage.PARAMETERS, 0.005).kept_frozen_units_per_rank == int(0.005 * 2**20)  # the budget
    assert kept(ZeroStage.PARAMETERS, 0).kept_frozen_units_per_rank == 0
    everything = kept(ZeroStage.PARAMETERS, math.inf)
    assert everything.device == kept(ZeroStage.PARAMETERS, 0).device  # between steps: nothing kept
    assert everything.device_during_backward == everything.device.total + 2 * frozen
    assert sizing.fits(everything, everything.device.total) is False
    assert sizing.fits(everything, everything.device_during_backward) is True
    with pytest.raises(ValueError, match="0 or more MiB"):
        kept(ZeroStage.PARAMETERS, -1)


def test_cli_takes_the_frozen_count(capsys: pytest.CaptureFixture) -> None:
    from lightning_zero.cli import main

    assert main(["estimate", "--params", "7.1B", "--frozen-params", "7B", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 frozen" in out
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "1B", "--frozen-params", "2B", "--devices", "8"])
    assert "more than the model's" in capsys.readouterr().err
    assert main(["estimate", "--params", "7.1B", "--frozen-params", "7B", "--keep-frozen-units-mb", "inf", "--devices", "8"]) == 0
    assert "+ kept frozen" in capsys.readouterr().out
    for bad in (["--keep-frozen-units-mb", "64"], ["--frozen-params", "1B", "--keep-frozen-units-mb", "-1"]):
        with pytest.raises(SystemExit):
            main(["estimate", "--params", "7.1B", *bad, "--devices", "8"])

"""CPU offload: the same training with optimizer state (and, at stage 3, parameter chunks) in host
memory, the memory report by location, and checkpoints shared with the non-offloaded runs."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 4
PRECISIONS = ("32-true", "bf16-mixed")
VARIANTS = {
    # name: (not offloaded, offloaded) strategy arguments
    "stage1": ({"stage": 1}, {"stage": 1, "offload_optimizer": True}),
    "stage2": ({"stage": 2}, {"stage": 2, "offload_optimizer": True}),
    "stage3_optimizer": ({"stage": 3}, {"stage": 3, "offload_optimizer": True}),
    "stage3_all": ({"stage": 3}, {"stage": 3, "offload_optimizer": True, "offload_params": True}),
}

CHECKPOINTS = {
    # label: the strategy that saves it (ZeroStrategy arguments, or a registered name)
    "offloaded_full": {"stage": 3, "offload_optimizer": True, "offload_params": True, "state_dict_type": "full"},
    "offloaded_sharded": "zero3_offload",
    "plain_sharded": "zero3",
}

RESUMES = [
    ("zero2", "offloaded_full"),
    ("zero3", "offloaded_sharded"),
    ("zero2", "offloaded_sharded"),
    ("zero2_offload", "plain_sharded"),
    ("zero3_offload", "plain_sharded"),
]


class _Report(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.report = trainer.strategy.memory_report()


GROUP = CaseGroup(world_size=2)


def offloaded_training(ctx: RankContext, label: str, precision: str) -> dict:
    """The offloaded variant and its not-offloaded twin fitted alike (with clipping): per-step
    weight differences, and the offloaded run's memory report by location."""
    import lightning_zero
    from lightning_helpers import fit_gpt, max_abs_diff

    plain, offloaded = VARIANTS[label]
    extra = dict(precision=precision, gradient_clip_val=0.5)
    # stage 3's two offload variants share their not-offloaded twin: fitted once per precision
    key = ("plain", tuple(sorted(plain.items())), precision)
    reference = ctx.once(key, lambda: fit_gpt(lightning_zero.ZeroStrategy(**plain), STEPS, **extra)[1])
    report = _Report()
    _, history, _ = fit_gpt(lightning_zero.ZeroStrategy(**offloaded), STEPS, callbacks=[report], **extra)
    return {"diffs": [max_abs_diff(a, b) for a, b in zip(reference, history)], "report": report.report}


for _label in VARIANTS:
    for _precision in PRECISIONS:
        GROUP.case(offloaded_training, name=f"train_{_label}_{_precision}", label=_label, precision=_precision)


# checkpoints: saved offloaded, resumed without; saved without, resumed offloaded. The
# reference is DDP resumed from the same state in its own (full) format.


def _last_checkpoint(ctx: RankContext, label: str) -> str:
    return os.path.join(ctx.tmpdir, label, "last.ckpt")


def save_checkpoint(ctx: RankContext, label: str) -> None:
    """Two steps under `CHECKPOINTS[label]`, saved as `<tmpdir>/<label>/last.ckpt` for the resumes."""
    import lightning_zero
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_gpt

    strategy = CHECKPOINTS[label]
    if isinstance(strategy, dict):
        strategy = lightning_zero.ZeroStrategy(**strategy)
    dirpath = os.path.dirname(_last_checkpoint(ctx, label))
    fit_gpt(strategy, 2, callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)], enable_checkpointing=True)


for _label in CHECKPOINTS:
    GROUP.case(save_checkpoint, name=f"save_{_label}", label=_label)


@GROUP.case
def resume_reference(ctx: RankContext) -> None:
    """DDP resumed from the offloaded full checkpoint: the history every resume is compared with."""
    from lightning_helpers import fit_gpt

    _, ctx.kept["resume_reference"], _ = fit_gpt("ddp", 4, ckpt_path=_last_checkpoint(ctx, "offloaded_full"))


def resume(ctx: RankContext, strategy: str, source: str) -> list:
    """`strategy` resumed from the `source` checkpoint: per-step differences from the DDP reference."""
    from lightning_helpers import fit_gpt, max_abs_diff

    _, history, _ = fit_gpt(strategy, 4, ckpt_path=_last_checkpoint(ctx, source))
    return [max_abs_diff(a, b) for a, b in zip(ctx.kept["resume_reference"], history)]


for _strategy, _source in RESUMES:
    GROUP.case(resume, name=f"resume_{_strategy}_from_{_source}", strategy=_strategy, source=_source)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("offload"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_offloaded_training_matches(results, label, precision):
    # The same arithmetic on host tensors; 1e-6 is the bound, bitwise is what we get.
    for r in results[f"train_{label}_{precision}"]:
        diffs = r["diffs"]
        assert len(diffs) == STEPS and max(diffs) <= 1e-6, diffs


def test_location_report(results):
    reports = {label: results[f"train_{label}_32-true"][0]["report"] for label in VARIANTS}
    for label in ("stage1", "stage2", "stage3_optimizer"):
        report = reports[label]
        assert report.device.optimizer_state == 0 and report.host.optimizer_state > 0
        assert report.host.gradients > 0  # gradient chunks are stepped on the host
    assert reports["stage3_optimizer"].device.parameters > 0  # chunks kept on the device to gather from
    all_offloaded = reports["stage3_all"]
    assert all_offloaded.device.parameters == 0 and all_offloaded.host.parameters > 0
    assert all_offloaded.device.optimizer_state == 0 and all_offloaded.device.gradients == 0


@pytest.mark.parametrize("name,source", RESUMES)
def test_checkpoints_cross_offload(results, name, source):
    for diffs in results[f"resume_{name}_from_{source}"]:
        assert diffs == [0.0, 0.0]  # steps 3 and 4, after resuming at step 2


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_params_refused_below_stage3(stage):
    import lightning_zero

    with pytest.raises(ValueError, match="needs stage 3"):
        lightning_zero.ZeroStrategy(stage=stage, offload_optimizer=True, offload_params=True)


def test_offload_params_needs_offload_optimizer():
    import lightning_zero

    with pytest.raises(ValueError, match="needs `offload_optimizer=True`"):
        lightning_zero.ZeroStrategy(stage=3, offload_params=True)


def test_one_device_script(tmp_path):
    """scripts/offload_one_device.py (issue 6's GPU check) on the CPU: same losses, state moved to the host."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "offload_one_device.py"
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--n-layer", "2", "--n-embd", "32", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    plain, offloaded = results["zero3"], results["zero3_offload"]
    assert plain["losses"] == offloaded["losses"]
    assert plain["model_state_host_bytes"] == 0 and offloaded["model_state_device_bytes"] == 0
    assert offloaded["model_state_host_bytes"] == plain["model_state_device_bytes"]

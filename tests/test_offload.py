"""CPU offload: the same training with optimizer state (and, at stage 3, parameter chunks) in host
memory, the memory report by location, and checkpoints shared with the non-offloaded runs."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.callbacks import Callback

from multiprocess import run_on_ranks

STEPS = 4
VARIANTS = {
    # name: (not offloaded, offloaded) strategy arguments
    "stage1": ({"stage": 1}, {"stage": 1, "offload_optimizer": True}),
    "stage2": ({"stage": 2}, {"stage": 2, "offload_optimizer": True}),
    "stage3_optimizer": ({"stage": 3}, {"stage": 3, "offload_optimizer": True}),
    "stage3_all": ({"stage": 3}, {"stage": 3, "offload_optimizer": True, "offload_params": True}),
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


def _offload_cases(rank: int, world_size: int, tmpdir: str) -> dict:
    import lightning_zero
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_gpt, max_abs_diff

    out: dict = {}
    for label, (plain, offloaded) in VARIANTS.items():
        for precision in ("32-true", "bf16-mixed"):
            extra = dict(precision=precision, gradient_clip_val=0.5)
            _, reference, _ = fit_gpt(lightning_zero.ZeroStrategy(**plain), STEPS, **extra)
            report = _Report()
            _, history, _ = fit_gpt(lightning_zero.ZeroStrategy(**offloaded), STEPS, callbacks=[report], **extra)
            out[(label, precision)] = [max_abs_diff(a, b) for a, b in zip(reference, history)]
            if precision == "32-true":
                out[(label, "report")] = report.report

    # checkpoints: saved offloaded, resumed without; saved without, resumed offloaded. The
    # reference is DDP resumed from the same state in its own (full) format.
    saved = {}
    for label, strategy in (
        ("offloaded_full", lightning_zero.ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, state_dict_type="full")),
        ("offloaded_sharded", "zero3_offload"),
        ("plain_sharded", "zero3"),
    ):
        dirpath = os.path.join(tmpdir, label)
        fit_gpt(strategy, 2, callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)], enable_checkpointing=True)
        saved[label] = os.path.join(dirpath, "last.ckpt")
    _, reference, _ = fit_gpt("ddp", 4, ckpt_path=saved["offloaded_full"])
    for name, source in RESUMES:
        _, history, _ = fit_gpt(name, 4, ckpt_path=saved[source])
        out[("resume", name, source)] = [max_abs_diff(a, b) for a, b in zip(reference, history)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_offload_cases, str(tmp_path_factory.mktemp("offload")), world_size=2, init_process_group=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("label", list(VARIANTS))
def test_offloaded_training_matches(results, label, precision):
    # The same arithmetic on host tensors; 1e-6 is the bound, bitwise is what we get.
    for r in results:
        diffs = r[(label, precision)]
        assert len(diffs) == STEPS and max(diffs) <= 1e-6, diffs


def test_location_report(results):
    r = results[0]
    for label in ("stage1", "stage2", "stage3_optimizer"):
        report = r[(label, "report")]
        assert report.device.optimizer_state == 0 and report.host.optimizer_state > 0
        assert report.host.gradients > 0  # gradient chunks are stepped on the host
    assert r[("stage3_optimizer", "report")].device.parameters > 0  # chunks kept on the device to gather from
    all_offloaded = r[("stage3_all", "report")]
    assert all_offloaded.device.parameters == 0 and all_offloaded.host.parameters > 0
    assert all_offloaded.device.optimizer_state == 0 and all_offloaded.device.gradients == 0


@pytest.mark.parametrize("name,source", RESUMES)
def test_checkpoints_cross_offload(results, name, source):
    for r in results:
        assert r[("resume", name, source)] == [0.0, 0.0]  # steps 3 and 4, after resuming at step 2


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

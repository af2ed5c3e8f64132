"""GPU tier, checkpoints across devices (world size 1): saved on ``cuda:0`` and resumed on the CPU,
saved there and resumed on CUDA, as a sharded directory (zero3) and as one full file (zero2 with
offload); the restored weights and optimizer state are the saved ones bit for bit, and the steps
after a restore agree across the devices. Skipped without a CUDA device (see ``cuda_tier.py``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

DEVICE_CHANGE_TOLERANCE = 1e-5
"""The same two steps after the same restore, computed on the CPU and on CUDA: float rounding only."""

CHECKPOINT = CaseGroup(world_size=1, timeout=600, start_method=START_METHOD)
CHECKPOINTS = {
    # label: ZeroStrategy arguments
    "zero3_sharded": {"stage": 3},
    "zero2_offload_full": {"stage": 2, "offload_optimizer": True, "state_dict_type": "full"},
}


def _state_now(trainer: Any, module: Any) -> dict[str, torch.Tensor]:
    """Full weights and full optimizer state, flat and on the CPU."""
    strategy = trainer.strategy
    with strategy.summon_full_params():
        state = {f"weights/{k}": v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    optimizer = strategy.engine.full_optimizer_state_dict(trainer.optimizers[0])
    for index, values in optimizer["state"].items():
        for key, value in values.items():
            state[f"optimizer/{index}/{key}"] = torch.as_tensor(value).to("cpu", copy=True)
    return state


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in tensors.items()}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or missing on one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _fit(label: str, max_steps: int, accelerator: str, save_to: str, ckpt_path: Any = None) -> tuple[dict, list]:
    """Fit under ``CHECKPOINTS[label]`` on ``accelerator``, saving every 2 steps into ``save_to``:
    the state right after the start (after a restore) and at every save, and the weights after each step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    import lightning_zero

    class States(L.Callback):
        def __init__(self) -> None:
            self.at: dict[Any, dict] = {}

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.at["start"] = _state_now(trainer, module)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step % 2 == 0:  # what ModelCheckpoint, which runs after this callback, saves
                self.at[trainer.global_step] = _state_now(trainer, module)

    states = States()
    saves = ModelCheckpoint(dirpath=save_to, every_n_train_steps=2, save_top_k=-1)
    _, history, _ = fit_and_record(
        lightning_zero.ZeroStrategy(**CHECKPOINTS[label]), max_steps, ckpt_path=ckpt_path, accelerator=accelerator,
        callbacks=[states, saves], enable_checkpointing=True,
    )  # fmt: skip
    return states.at, history


def across_devices(ctx: RankContext, label: str) -> dict:
    """2 steps on CUDA, saved; resumed from it on the CPU for steps 3-4, saved; that resumed on CUDA
    for steps 5-6. What each restore got that the save did not hold, and the CPU's steps 3-4
    against the same resume on CUDA (Lightning restarts the epoch's data on a resume, so an
    uninterrupted run is no reference)."""
    from lightning_helpers import max_abs_diff

    setup_rank(deterministic=True)
    root = os.path.join(ctx.tmpdir, label)
    saved_on_cuda = os.path.join(root, "cuda", "epoch=0-step=2.ckpt")
    saved_on_cpu = os.path.join(root, "cpu", "epoch=0-step=4.ckpt")
    on_cuda, _ = _fit(label, 2, "cuda", os.path.dirname(saved_on_cuda))
    on_cpu, cpu_history = _fit(label, 4, "cpu", os.path.dirname(saved_on_cpu), saved_on_cuda)
    _, cuda_history = _fit(label, 4, "cuda", os.path.join(root, "cuda_again"), saved_on_cuda)
    back, _ = _fit(label, 6, "cuda", os.path.join(root, "back"), saved_on_cpu)
    return {
        "saved_on_cuda_restored_on_cpu": _differing(on_cuda[2], on_cpu["start"]),
        "saved_on_cpu_restored_on_cuda": _differing(on_cpu[4], back["start"]),
        "cpu_steps_vs_cuda_steps": [max_abs_diff(_on_cpu(a), b) for a, b in zip(cuda_history, cpu_history)],
    }


for _label in CHECKPOINTS:
    CHECKPOINT.case(across_devices, name=_label, label=_label)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> GroupResults:
    return CHECKPOINT.run(tmp_path_factory.mktemp("cuda_checkpoints"))


@pytest.mark.parametrize("label", list(CHECKPOINTS))
def test_a_checkpoint_saved_on_cuda_resumes_on_cpu_and_back(checkpoints, label):
    (r,) = checkpoints[label]
    assert r["saved_on_cuda_restored_on_cpu"] == [], "restored values differ from the saved ones"
    assert r["saved_on_cpu_restored_on_cuda"] == [], "restored values differ from the saved ones"
    diffs = r["cpu_steps_vs_cuda_steps"]
    assert len(diffs) == 2 and max(diffs) <= DEVICE_CHANGE_TOLERANCE, r

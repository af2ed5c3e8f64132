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


ASYNC_COPIES = {
    # label: ZeroConfig arguments
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},  # host chunks beside device buffers
}


def async_save_copies(ctx: RankContext, device: Any = None) -> dict:
    """Engine-level asynchronous saves (two, the second into the arena the first arranged) at every
    ``ASYNC_COPIES`` entry: per save, the device-to-host copies of the save's foreground whose source
    is a saved tensor, blocking and non-blocking (torch's dispatcher sees every ``copy_`` and
    ``_to_copy``), the staging's stream synchronizations (``wait_for_copies`` calls), how many saved
    tensors are on the device; and the keys a fresh engine loading the last save holds differently.
    ``device``: cuda:0 (a CPU run of the same code only finds no device copies)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_zero.checkpoint import async_save
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    device = setup_rank(deterministic=True) if device is None else device

    class DeviceToHost(TorchDispatchMode):
        def __init__(self, sources: set) -> None:
            super().__init__()
            self.sources, self.blocking, self.non_blocking = sources, 0, 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            src, to_host, non_blocking = None, False, False
            if func is torch.ops.aten.copy_.default:
                src, to_host = args[1], args[0].device.type == "cpu"
                non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            elif func is torch.ops.aten._to_copy.default:
                src, to_host = args[0], torch.device(kwargs.get("device") or args[0].device).type == "cpu"
                non_blocking = bool(kwargs.get("non_blocking", False))
            if src is not None and to_host and src.device.type != "cpu" and src.numel() > 0 and src.data_ptr() in self.sources:
                if non_blocking:
                    self.non_blocking += 1
                else:
                    self.blocking += 1
            return func(*args, **kwargs)

    class Ranks:
        is_global_zero, world_size = True, 1

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return obj

        def barrier(self, name: Any = None) -> None:
            pass

    def made(config: dict, seed: int) -> tuple:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(**config), device=device)
        x, y = torch.randn(16, 32, device=device), torch.randn(16, 8, device=device)

        def step() -> None:
            engine.begin_step()
            torch.nn.functional.mse_loss(model(x), y).backward()
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()

        return model, optimizer, engine, step

    def state_of(model: Any, engine: Any, optimizer: Any) -> dict:
        chunks = engine.weight_chunks()
        state = {f"chunk/{sp.name}": chunks[id(sp)].detach().to("cpu", copy=True) for sp in engine.params}
        for position, values in engine.optimizer_chunked_state(optimizer)[0]["state"].items():
            state.update({f"optim/{position}/{k}": torch.as_tensor(v).to("cpu", copy=True) for k, v in values.items()})
        state.update({f"buffer/{k}": v.to("cpu", copy=True) for k, v in model.named_buffers()})
        return state

    syncs: list = []

    def counted(original: Any) -> Any:
        def wait(devices: Any) -> None:
            syncs.append(len(devices))
            original(devices)

        return wait

    out: dict = {}
    original_wait = async_save.wait_for_copies
    async_save.wait_for_copies = counted(original_wait)
    try:
        for label, config in ASYNC_COPIES.items():
            checkpointing = ZeroCheckpointing("sharded", async_save=True)
            model, optimizer, engine, step = made(config, seed=0)
            saves = []
            for index in range(2):
                step()
                saved = state_of(model, engine, optimizer)
                checkpoint = {
                    "state_dict": checkpointing.module_shards(model, engine),
                    "optimizer_states": [checkpointing.optimizer_shards(engine, [optimizer], optimizer)],
                }
                entries = {**checkpoint["state_dict"], **checkpoint["optimizer_states"][0].tensors}
                locals_ = [v.to_local() if isinstance(v, DTensor) else v for v in entries.values()]
                on_device = {t.data_ptr() for t in locals_ if t.device.type != "cpu" and t.numel() > 0}
                del syncs[:]
                path = os.path.join(ctx.tmpdir, f"async_copies_{label}")
                with DeviceToHost(on_device) as copies:
                    checkpointing.save(Ranks(), checkpoint, path, model, engine, write_file=lambda c, p: None)
                saves.append({"blocking": copies.blocking, "non_blocking": copies.non_blocking, "syncs": list(syncs), "on_device": len(on_device)})
            step()  # while the last write may be in flight
            checkpointing.release()
            fresh_model, fresh_optimizer, fresh_engine, fresh_step = made(config, seed=1)
            fresh_step()
            ZeroCheckpointing("sharded").load(path, fresh_model, fresh_engine, [fresh_optimizer], True, read_file=lambda p: {}, weights_only=True)
            loaded = state_of(fresh_model, fresh_engine, fresh_optimizer)
            differing = sorted(k for k in saved.keys() | loaded.keys() if k not in saved or k not in loaded or not torch.equal(saved[k], loaded[k]))
            engine.close()
            fresh_engine.close()
            out[label] = {"saves": saves, "differing": differing}
    finally:
        async_save.wait_for_copies = original_wait
    return out


CHECKPOINT.case(async_save_copies)


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


@pytest.mark.parametrize("label", list(ASYNC_COPIES))
def test_an_async_save_copies_each_device_tensor_once_with_one_stream_sync(checkpoints, label):
    """Each device tensor straight into the pinned arena with one non-blocking copy, no blocking
    device-to-host copy (the checkpoint hooks' `.to("cpu")` made one per tensor before, then the
    arena a second copy), one stream synchronization per save; the last save loads back bitwise."""
    (r,) = checkpoints["async_save_copies"]
    case = r[label]
    for save in case["saves"]:
        assert save["on_device"] > 0 and save["blocking"] == 0, case
        assert save["non_blocking"] == save["on_device"], case
        assert save["syncs"] == [1], case  # one call, one device
    assert case["differing"] == [], case

"""Buffers in checkpoints are rank 0's, as DDP's are: a model with BatchNorm (``models.ConvBatchNorm``)
on 2 CPU ranks that read different batches, so their running statistics differ after every step.

Every checkpoint kind — sharded at stages 1-3 and offloaded (zero2 ``offload_optimizer``, zero3
``offload_params``), ``async_save``, a full file, a sharded one in an S3 bucket (moto's server,
``s3_server.py``); the Trainer's and Fabric's — holds DDP's checkpoint's buffers bit for bit, in its
single-file form and after ``convert``. A resume gives every rank the checkpoint's weights and
buffers, and every step before the save and after the resume is DDP's uninterrupted run's, bit for
bit, buffers included (Fabric's loop: also its own uninterrupted run's). A 1-rank run resumes a
2-rank checkpoint (a reshard) with the same buffers. The plan that decides it is tested in one process.

All 2-rank cases run in one group of ranks (``GROUP``); the reshard in a second, of one rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from multiprocess import run_on_ranks

GROUP = CaseGroup(world_size=2, timeout=240)
STEPS, EPOCH = 4, 2
"""16 samples, batches of 4 on 2 ranks: 2 steps an epoch; the runs save after the first epoch."""
BUCKET = "s3://bucket"
HAS_S3 = all(importlib.util.find_spec(name) is not None for name in ("moto", "s3fs"))
"""moto's S3 server and s3fs (the `test` extra): the case saving into a bucket needs both."""
BUFFER_KEYS = ("model.norm.running_mean", "model.norm.running_var", "model.norm.num_batches_tracked")
"""The LightningModule's buffers (``RegressionModule`` holds ``ConvBatchNorm`` as ``model``)."""

EXACT = {"fused_host_step": False}  # AdamW's own kernel on the host: offloaded runs are bitwise DDP's
TRAINER_RUNS: dict[str, dict[str, Any]] = {
    # name: ZeroStrategy's arguments
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload_optimizer": {"stage": 2, "offload_optimizer": True, **EXACT},
    "zero3_offload_params": {"stage": 3, "offload_optimizer": True, "offload_params": True, **EXACT},
    "zero3_async": {"stage": 3, "async_save": True},
    "zero2_full": {"stage": 2, "state_dict_type": "full"},
}
if HAS_S3:
    TRAINER_RUNS["zero3_remote"] = {"stage": 3}  # saved into the bucket, resumed from it
FABRIC_RUNS: dict[str, dict[str, Any]] = {
    # name: ZeroFabricStrategy's arguments
    "zero3": {"stage": 3},
    "zero1_full": {"stage": 1, "state_dict_type": "full"},
}


def image_data() -> Any:
    """The same 16 images on every rank; Lightning's DistributedSampler gives each rank its half."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randn(16, 2, 4, 4, generator=g), torch.randn(16, 3, generator=g)), batch_size=4)


def _buffers(state: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {key: state[prefix + key[len("model.") :]].clone() for key in BUFFER_KEYS}


class _States(Callback):
    """This rank's whole state (full weights and buffers): right after a restore, and after each step."""

    def __init__(self) -> None:
        self.restored: Optional[dict[str, torch.Tensor]] = None
        self.steps: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def _state(trainer: Any, pl_module: Any) -> dict[str, torch.Tensor]:
        summon = getattr(trainer.strategy, "summon_full_params", contextlib.nullcontext)
        with summon():
            return {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.restored = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.steps.append(self._state(trainer, pl_module))


def _fit(strategy: Any, epochs: int, root: str, ckpt_path: Optional[str] = None, save_to: Optional[str] = None) -> _States:
    """Fit ``epochs`` epochs (from ``ckpt_path``), then save to ``save_to``. Saved after ``fit``, a
    checkpoint resumes at the next epoch's first batch, as the uninterrupted run goes on (one saved
    by ``ModelCheckpoint`` at an epoch's end makes Lightning re-enter that epoch)."""
    import lightning as L
    from lightning_helpers import RegressionModule, make_trainer
    from models import ConvBatchNorm

    L.seed_everything(0, verbose=False)
    states = _States()
    trainer = make_trainer(strategy, -1, callbacks=[states], max_epochs=epochs, default_root_dir=root)
    trainer.fit(RegressionModule(make_model=ConvBatchNorm), image_data(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
        # with async_save, a save after fit is waited for by this strategy only: not by another's load
        getattr(trainer.strategy, "wait_for_checkpoint", lambda: None)()
    return states


def _saved_buffers(path: str) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds, read in this process as a file (a directory's single-file form)."""
    from lightning_zero import checkpoint_file

    return _buffers(torch.load(checkpoint_file(path), weights_only=True)["state_dict"])


@GROUP.case
def trainer_ddp(ctx: RankContext) -> dict[str, Any]:
    """DDP's uninterrupted run (every rank's state after each step) and its checkpoint after the
    first epoch (rank 0: the buffers it holds)."""
    path = os.path.join(ctx.tmpdir, "trainer_ddp.ckpt")
    _fit("ddp", 1, ctx.tmpdir, save_to=path)
    steps = _fit("ddp", 2, ctx.tmpdir).steps
    return {"steps": steps, "saved": _saved_buffers(path) if ctx.rank == 0 else None}


def trainer_run(ctx: RankContext, run: str) -> dict[str, Any]:
    """The first epoch, saved, then the second resumed from it: every rank's state after each step
    and right after the restore; (rank 0) the buffers the checkpoint holds, as a file and after
    ``convert``."""
    from lightning_zero import ZeroStrategy, convert_checkpoint

    arguments = TRAINER_RUNS[run]
    path = f"{BUCKET}/{run}.ckpt" if run.endswith("_remote") else os.path.join(ctx.tmpdir, f"trainer_{run}.ckpt")
    first = _fit(ZeroStrategy(**arguments), 1, ctx.tmpdir, save_to=path)
    resumed = _fit(ZeroStrategy(**arguments), 2, ctx.tmpdir, ckpt_path=path)
    out: dict[str, Any] = {"steps": first.steps + resumed.steps, "restored": resumed.restored}
    if ctx.rank == 0:
        out["saved"] = _saved_buffers(path)
        if arguments.get("state_dict_type", "sharded") == "sharded":
            converted = convert_checkpoint(path, os.path.join(ctx.tmpdir, f"converted_{run}.ckpt"))
            out["converted"] = _buffers(torch.load(converted, weights_only=True)["state_dict"])
    return out


for _run in TRAINER_RUNS:
    GROUP.case(trainer_run, name=f"trainer_{_run}", run=_run)


# ---- Fabric: a plain loop, each rank its own batches ---------------------------------------------
def _fabric_state(fabric: Any, model: Any) -> dict[str, torch.Tensor]:
    """This rank's whole state (gathered at stage 3), keyed as the Trainer's LightningModule keys it."""
    state = fabric.strategy.get_module_state_dict(model.module)
    return {f"model.{k}": v.detach().clone() for k, v in state.items()}


def fabric_run(ctx: RankContext, run: str) -> dict[str, Any]:
    """As ``trainer_run``, in a Fabric loop that saves after step ``EPOCH`` (``run`` "ddp": Fabric's DDP)."""
    from fabric_loop import fabric_for
    from models import ConvBatchNorm

    g = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own batches
    batches = [(torch.randn(4, 2, 4, 4, generator=g), torch.randn(4, 3, generator=g)) for _ in range(STEPS)]
    path = os.path.join(ctx.tmpdir, f"fabric_{run}")

    def setup(seed: int) -> tuple[Any, Any, Any]:
        fabric = fabric_for("ddp" if run == "ddp" else f"zero{FABRIC_RUNS[run]['stage']}", **_fabric_options(run))
        fabric.seed_everything(seed)
        module = ConvBatchNorm()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1))
        return fabric, model, optimizer

    def train(fabric: Any, model: Any, optimizer: Any, steps: list, save_after: int = -1) -> list[dict[str, torch.Tensor]]:
        states = []
        for step, (x, y) in enumerate(steps, start=1):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            states.append(_fabric_state(fabric, model))
            if step == save_after:
                fabric.save(path, {"model": model, "optimizer": optimizer})
        return states

    fabric, model, optimizer = setup(0)
    out: dict[str, Any] = {"steps": train(fabric, model, optimizer, batches, save_after=EPOCH)}
    if run != "ddp":
        fabric, model, optimizer = setup(1)  # other initial weights: the checkpoint must replace them all
        fabric.load(path, {"model": model, "optimizer": optimizer})
        out["restored"] = _fabric_state(fabric, model)
        out["resumed"] = train(fabric, model, optimizer, batches[EPOCH:])
    if ctx.rank == 0:
        from lightning_zero import checkpoint_file

        saved = torch.load(checkpoint_file(path), weights_only=True)
        # a file (DDP's, a full one) keeps Fabric's name; a directory's single-file form, the Trainer's
        out["saved"] = _buffers(saved["state_dict"] if "state_dict" in saved else saved["model"], prefix="")
    return out


def _fabric_options(run: str) -> dict[str, Any]:
    return {} if run == "ddp" else {k: v for k, v in FABRIC_RUNS[run].items() if k != "stage"}


for _run in ("ddp", *FABRIC_RUNS):
    GROUP.case(fabric_run, name=f"fabric_{_run}", run=_run)


# ---- the plan, in one process ---------------------------------------------------------------------
def _local_plans(planner_type: type) -> list[Any]:
    """Two ranks' local save plans: whole entries that both hold (different buffers, the same step
    count) and DTensor-like chunks: one of ``model/w`` each, and one of ``model/h`` that both hold
    (a hybrid mesh's replicas)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def chunk(fqn: str, offset: int, numel: int, total: int) -> WriteItem:
        piece = ChunkStorageMetadata(torch.Size([offset]), torch.Size([numel]))
        data = TensorWriteData(piece, TensorProperties(torch.float32), torch.Size([total]))
        return WriteItem(MetadataIndex(fqn, [offset]), WriteItemType.SHARD, tensor_data=data)

    plans = []
    for rank in range(2):
        planner = planner_type()
        whole = {f"buffer/b{i}": torch.full((4,), float(rank)) for i in range(4)}
        planner.set_up_planner({**whole, "optim/0/w/step": torch.tensor(3.0)}, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        chunks = [chunk("model/w", 3 * rank, 3, 6), chunk("model/h", 0, 4, 4)]
        plans.append(dataclasses.replace(plan, items=[*plan.items, *chunks]))
    return plans


def _writers(planner_type: type) -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """The ranks that write each item once the coordinator planned the save, by (key, offset)."""
    global_plans, _ = planner_type().create_global_plan(_local_plans(planner_type))
    writers: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for rank, plan in enumerate(global_plans):
        for item in plan.items:
            writers.setdefault((item.index.fqn, tuple(item.index.offset)), []).append(rank)
    return writers


def test_rank_0_writes_every_whole_entry_and_chunks_stay_dcps():
    from torch.distributed.checkpoint import DefaultSavePlanner

    from lightning_zero.checkpoint.save_plan import RankZeroWholeEntries

    whole = [(f"buffer/b{i}", (0,)) for i in range(4)] + [("optim/0/w/step", ())]
    # DCP's own planner balances the ranks' bytes: some buffer would be rank 1's
    assert any(_writers(DefaultSavePlanner)[key] == [1] for key in whole)
    writers = _writers(RankZeroWholeEntries)
    assert {key: writers[key] for key in whole} == {key: [0] for key in whole}
    # each rank writes its own chunk; a chunk both hold is written once
    assert writers[("model/w", (0,))] == [0] and writers[("model/w", (3,))] == [1]
    assert len(writers[("model/h", (0,))]) == 1
    assert len(writers) == len(whole) + 3


# ---- the parent's side ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("buffers"))


@pytest.fixture(scope="module")
def results(root, tmp_path_factory) -> GroupResults:
    with contextlib.ExitStack() as stack:
        if HAS_S3:
            from s3_server import S3Server

            server = S3Server(str(tmp_path_factory.mktemp("s3"))).start()
            stack.callback(server.stop)
        return GROUP.run(root)


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), f"{what}: {key} differs"


def _check_run(run: list[dict[str, Any]], ddp: list[dict[str, Any]]) -> None:
    """``run``'s results against DDP's, see the module's docstring."""
    # the premise: the ranks' running statistics differ, so a checkpoint of rank 1's would fail
    assert not torch.equal(*(r["steps"][EPOCH - 1]["model.norm.running_mean"] for r in ddp))
    # DDP's checkpoint holds its rank 0's buffers
    expected = ddp[0]["saved"]
    _assert_equal(expected, _buffers(ddp[0]["steps"][EPOCH - 1]), "DDP's checkpoint against its rank 0")
    # and so does ours: its single-file form and convert's
    _assert_equal(run[0]["saved"], expected, "the checkpoint's buffers against DDP's checkpoint's")
    if "converted" in run[0]:
        _assert_equal(run[0]["converted"], expected, "the converted checkpoint's buffers against DDP's checkpoint's")
    for rank, (ours, theirs) in enumerate(zip(run, ddp)):
        # a restore gives every rank the checkpoint's weights and buffers: rank 0's at the save
        _assert_equal(ours["restored"], run[0]["steps"][EPOCH - 1], f"rank {rank} right after the restore against rank 0 at the save")
        # every step, before the save and after the resume, as DDP's uninterrupted run: weights and buffers bitwise
        assert len(ours["steps"]) == len(theirs["steps"]) == STEPS
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"]), start=1):
            _assert_equal(a, b, f"rank {rank}, step {step} against DDP's uninterrupted run")
        if "resumed" in ours:  # a loop of our own: the resumed steps against its uninterrupted run
            assert len(ours["resumed"]) == STEPS - EPOCH
            for step, (a, b) in enumerate(zip(ours["resumed"], ours["steps"][EPOCH:]), start=EPOCH + 1):
                _assert_equal(a, b, f"rank {rank}, step {step} resumed against uninterrupted")


@pytest.mark.parametrize("run", list(TRAINER_RUNS))
def test_trainer_checkpoints_hold_rank_0s_buffers_and_resume_bitwise(results, run):
    """The first epoch's steps, then the resumed run's, against DDP's uninterrupted run."""
    _check_run(results[f"trainer_{run}"], results["trainer_ddp"])


@pytest.mark.parametrize("run", list(FABRIC_RUNS))
def test_fabric_checkpoints_hold_rank_0s_buffers_and_resume_bitwise(results, run):
    _check_run(results[f"fabric_{run}"], results["fabric_ddp"])


def _restored_on_one_rank(rank: int, world_size: int, path: str, root: str) -> dict[str, torch.Tensor]:
    from lightning_zero import ZeroStrategy

    return _fit(ZeroStrategy(stage=2), 2, root, ckpt_path=path).restored


def test_a_reshard_onto_one_rank_restores_rank_0s_buffers(results, root):
    """zero3's 2-rank checkpoint resumed at zero2 on 1 rank: rank 0's state at the save."""
    saved_at = results["trainer_zero3"][0]["steps"][EPOCH - 1]
    path = os.path.join(root, "trainer_zero3.ckpt")
    (restored,) = run_on_ranks(_restored_on_one_rank, path, root, world_size=1, init_process_group=False)
    _assert_equal(restored, saved_at, "the 1-rank restore against rank 0 at the save")
    _assert_equal(_buffers(restored), results["trainer_ddp"][0]["saved"], "the 1-rank restore's buffers against DDP's checkpoint's")

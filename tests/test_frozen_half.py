"""A frozen half-precision base (``precision="bf16-true"``, a LoRA-style fine-tune) keeps its stage-3
chunks in bf16, with no fp32 master and, offloaded, no device copy (see [Note: frozen chunks] in
``engine/shards/sharded_param.py``):

- training is bitwise what it was with fp32 chunks (the engine's old layout, rebuilt here by
  patching ``holds_master_copy``) and what stage 2 gives, with and without ``offload_params``
  (CPU and NVMe);
- ``memory_report()`` counts 2 B per frozen parameter / N, on the device or (offloaded) the host;
- a checkpoint saved at stage 3 holds bf16 chunks and loads at stages 3 and 2 and on one rank; one
  saved with the old fp32 chunks loads the same (DCP reads an entry in its saved dtype and the
  chunk takes it with a cast, exact: the values were bf16 to begin with).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from lora_models import IN_FEATURES, LoraStack, frozen_numel

STEPS = 3
LAYOUTS = {
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    "zero3_offload_optimizer": dict(stage=3, offload_optimizer=True),
    "zero3_nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
}
SAVED_BY = "zero3"
"""The layout the checkpoint cases save with (stage 3, as the task's base runs)."""

GROUP = CaseGroup(world_size=2, timeout=400)
ONE_RANK = CaseGroup(world_size=1)


def _model(base_seed: int = 0) -> LoraStack:
    """Every parameter's numel even: 2 ranks' chunks need no padding. ``base_seed`` picks the
    weights (a different one: a module whose weights a load must replace)."""
    torch.manual_seed(base_seed)
    return LoraStack(out_features=4)


@contextlib.contextmanager
def _old_layout() -> Iterator[None]:
    """The engine as it was before frozen chunks kept their dtype: every half-precision chunk an fp32
    master copy, frozen or not, and with the optimizer offloaded every chunk on the host (both
    functions are read by name when a parameter is sharded)."""
    from lightning_zero.engine.parameters import materialize
    from lightning_zero.engine.shards import sharded_param

    originals = sharded_param.holds_master_copy, materialize._chunk_place
    sharded_param.holds_master_copy = lambda p: p.dtype in (torch.float16, torch.bfloat16)
    materialize._chunk_place = lambda p, host, keep_device_chunks: dict(host=host, keep_device_chunk=keep_device_chunks)
    try:
        yield
    finally:
        sharded_param.holds_master_copy, materialize._chunk_place = originals


def _set_up(ctx: RankContext, layout: str, base_seed: int = 0, world_size: int = 2) -> tuple:
    from datetime import timedelta

    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    options = dict(LAYOUTS[layout])
    if options.get("offload_params") == "nvme":
        options["nvme_path"] = os.path.join(ctx.tmpdir, f"nvme_{layout}_{world_size}", str(ctx.rank))
        os.makedirs(options["nvme_path"], exist_ok=True)
    strategy = ZeroFabricStrategy(**options, timeout=timedelta(seconds=90))
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-true")
    fabric.launch()
    module = _model(base_seed)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(module, optimizer)
    return fabric, model, optimizer


def _step(fabric: Any, model: Any, optimizer: Any, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, IN_FEATURES, generator=g)
    fabric.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def _weights(fabric: Any, model: Any) -> dict[str, torch.Tensor]:
    with fabric.strategy.summon_full_params(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(fabric: Any, model: Any) -> Any:
    return fabric.strategy._modules.of(model.module).engine


def _frozen_chunk_dtypes(fabric: Any, model: Any) -> set[str]:
    """The dtypes of the stage-3 chunks of the frozen parameters (empty where none is chunked)."""
    return {str(sp.shard.dtype) for sp in _engine(fabric, model).params if not sp.keeps_full and not sp.param.requires_grad}


def _saved_dtypes(path: str) -> dict[str, str]:
    """The dtype of each frozen parameter's entry in a sharded checkpoint's DCP metadata."""
    from lightning_zero.checkpoint.storage import read_dcp_metadata

    frozen = {name for name, p in _model().named_parameters() if not p.requires_grad}
    metadata = read_dcp_metadata(path).state_dict_metadata
    return {name: str(metadata[f"model/{name}"].properties.dtype) for name in frozen}


# ---- (a) and (b): training and memory -------------------------------------------------------------
def train(ctx: RankContext, layout: str, old: bool = False) -> dict[str, Any]:
    """``STEPS`` steps; the weights after, the memory report and the frozen chunks' dtypes."""
    with _old_layout() if old else contextlib.nullcontext():
        fabric, model, optimizer = _set_up(ctx, layout)
        for i in range(STEPS):
            _step(fabric, model, optimizer, i)
        return dict(
            weights=_weights(fabric, model),
            report=_engine(fabric, model).memory_report(),
            chunk_dtypes=_frozen_chunk_dtypes(fabric, model),
        )


for _layout in LAYOUTS:
    GROUP.case(train, name=_layout, layout=_layout)
for _layout in ("zero3", "zero3_offload", "zero3_offload_optimizer"):
    GROUP.case(train, name=f"{_layout}_old", layout=_layout, old=True)


# ---- (c): checkpoints ------------------------------------------------------------------------------
def save(ctx: RankContext, old: bool) -> dict[str, Any]:
    """One step at stage 3, saved (with the old fp32 chunks where ``old``), then a second step: the
    weights saved, the dtypes of the frozen entries, and the weights one step after the save."""
    with _old_layout() if old else contextlib.nullcontext():
        fabric, model, optimizer = _set_up(ctx, SAVED_BY)
        _step(fabric, model, optimizer, 0)
        saved = _weights(fabric, model)
        path = os.path.join(ctx.tmpdir, "old" if old else "new")
        fabric.save(path, {"model": model, "optimizer": optimizer})
        _step(fabric, model, optimizer, 1)
        return dict(saved=saved, dtypes=_saved_dtypes(path), next_step=_weights(fabric, model))


def load(ctx: RankContext, saved_by: str, layout: str) -> dict[str, Any]:
    """A module built from other weights loads the checkpoint: the weights then, the frozen chunks'
    dtypes, and the weights one step later."""
    fabric, model, optimizer = _set_up(ctx, layout, base_seed=1, world_size=ctx.world_size)
    fabric.load(os.path.join(ctx.tmpdir, saved_by), {"model": model, "optimizer": optimizer})
    loaded = _weights(fabric, model)
    dtypes = _frozen_chunk_dtypes(fabric, model)
    _step(fabric, model, optimizer, 1)
    return dict(loaded=loaded, chunk_dtypes=dtypes, next_step=_weights(fabric, model))


GROUP.case(save, name="save_new", old=False)
GROUP.case(save, name="save_old", old=True)
for _saved_by in ("new", "old"):
    for _layout in ("zero3", "zero2", "zero3_offload"):
        GROUP.case(load, name=f"load_{_saved_by}_{_layout}", saved_by=_saved_by, layout=_layout)
    ONE_RANK.case(load, name=f"load_{_saved_by}_one_rank", saved_by=_saved_by, layout="zero3")


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("frozen_half")


@pytest.fixture(scope="module")
def results(shared_dir: Any) -> GroupResults:
    return GROUP.run(shared_dir)


@pytest.fixture(scope="module")
def one_rank_results(results: GroupResults, shared_dir: Any) -> GroupResults:
    return ONE_RANK.run(shared_dir)  # after the 2-rank group wrote its checkpoints


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b)
    return sorted(k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])))


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "zero2"])
def test_training_is_bitwise_stage_2s(results: GroupResults, layout: str) -> None:
    for mine, reference in zip(results[layout], results["zero2"]):
        assert _differing(mine["weights"], reference["weights"]) == []
        assert all(t.dtype == torch.bfloat16 for t in mine["weights"].values())


@pytest.mark.parametrize("layout", ["zero3", "zero3_offload", "zero3_offload_optimizer"])
def test_training_is_bitwise_the_old_layouts(results: GroupResults, layout: str) -> None:
    for new, old in zip(results[layout], results[f"{layout}_old"]):
        assert old["chunk_dtypes"] == {"torch.float32"}  # the patch did rebuild the old layout
        assert new["chunk_dtypes"] == {"torch.bfloat16"}
        assert _differing(new["weights"], old["weights"]) == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_frozen_chunks_are_2_bytes_per_parameter_per_rank(results: GroupResults, layout: str) -> None:
    frozen, n = frozen_numel(_model()), GROUP.world_size
    for r in results[layout]:
        report = r["report"]
        if layout == "zero2":  # in no optimizer: whole on every rank, in bf16
            assert (report.frozen_device, report.frozen_host) == (2 * frozen, 0)
        elif layout in ("zero3", "zero3_offload_optimizer"):  # no host step reads it: on the device only
            assert (report.frozen_device, report.frozen_host) == (2 * frozen // n, 0)
        elif layout == "zero3_offload":  # the host chunk, in bf16, is the only copy
            assert (report.frozen_device, report.frozen_host) == (0, 2 * frozen // n)
        else:  # on disk between uses: in neither
            assert (report.frozen_device, report.frozen_host) == (0, 0)
        assert r["chunk_dtypes"] == (set() if layout == "zero2" else {"torch.bfloat16"})


def test_old_layout_held_twice_the_bytes(results: GroupResults) -> None:
    """What the change saves: the old fp32 chunks (and, offloaded, a bf16 device copy besides)."""
    frozen, n = frozen_numel(_model()), GROUP.world_size
    for old in results["zero3_old"]:
        assert old["report"].frozen_device == 4 * frozen // n
    for layout in ("zero3_offload", "zero3_offload_optimizer"):
        for old in results[f"{layout}_old"]:
            assert (old["report"].frozen_device, old["report"].frozen_host) == (2 * frozen // n, 4 * frozen // n)


def test_estimator_agrees_for_a_frozen_bf16_base(results: GroupResults) -> None:
    from lightning_zero import ZeroStrategy
    from lightning_zero.lightning.memory_monitor import estimate_per_rank

    model = _model()
    total, frozen = sum(p.numel() for p in model.parameters()), frozen_numel(model)
    trained_chunks = 2 * (total - frozen) // GROUP.world_size
    for layout in ("zero3", "zero3_offload", "zero3_offload_optimizer"):
        predicted = estimate_per_rank(total, ZeroStrategy(**LAYOUTS[layout]), "bf16-true", devices=GROUP.world_size, nodes=1, frozen_params=frozen)
        for r in results[layout]:
            report = r["report"]
            # at rest without offload a trained weight's only chunk is its fp32 master (optimizer
            # state); the estimate prices a bf16 chunk of it as well: the frozen bytes agree
            unpriced = trained_chunks if layout == "zero3" else 0
            assert report.device.parameters + unpriced == predicted.device.parameters, layout
            assert report.host.parameters == predicted.host.parameters, layout


def test_checkpoint_holds_frozen_chunks_in_their_dtype(results: GroupResults) -> None:
    for new, old in zip(results["save_new"], results["save_old"]):
        assert set(new["dtypes"].values()) == {"torch.bfloat16"}
        assert set(old["dtypes"].values()) == {"torch.float32"}  # the layout written before the change
        assert _differing(new["saved"], old["saved"]) == []


@pytest.mark.parametrize("saved_by", ["new", "old"])
@pytest.mark.parametrize("layout", ["zero3", "zero2", "zero3_offload"])
def test_checkpoint_loads_at_stages_3_and_2(results: GroupResults, saved_by: str, layout: str) -> None:
    """Both layouts' checkpoints load (DCP reads each entry in its saved dtype, the chunk casts it);
    the next step is bitwise the saving run's."""
    for saved, loaded in zip(results[f"save_{saved_by}"], results[f"load_{saved_by}_{layout}"]):
        assert _differing(loaded["loaded"], saved["saved"]) == []
        assert _differing(loaded["next_step"], saved["next_step"]) == []
        assert loaded["chunk_dtypes"] == (set() if layout == "zero2" else {"torch.bfloat16"})


@pytest.mark.parametrize("saved_by", ["new", "old"])
def test_checkpoint_loads_on_one_rank(results: GroupResults, one_rank_results: GroupResults, saved_by: str) -> None:
    saved = results[f"save_{saved_by}"][0]["saved"]
    (loaded,) = one_rank_results[f"load_{saved_by}_one_rank"]
    assert _differing(loaded["loaded"], saved) == []
    assert loaded["chunk_dtypes"] == {"torch.bfloat16"}

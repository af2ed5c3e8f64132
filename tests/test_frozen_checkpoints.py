"""Checkpoints without the frozen weights (``save_frozen=False``) of a LoRA fine-tune: a
transformers Llama (small config, no download) with PEFT adapters, 2 ranks, at zero1, zero2, zero3
and zero3 with offload: resume bitwise equal to an uninterrupted run, the checkpoint's size that of
the trainable state, a changed base refused naming it, resume at another stage and world size,
Fabric's save/load, ``load_from_checkpoint``, and ``verify`` / ``convert`` with and without a base."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext, error_of

pytest.importorskip("peft")
pytest.importorskip("transformers")

STAGES = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
}
ALTERED = "model.base_model.model.model.layers.1.mlp.down_proj.weight"
"""The frozen weight the "changed base" cases alter."""
BASE_SEED = 1234


class LoraLlama(L.LightningModule):
    """A small Llama with LoRA adapters on q_proj and v_proj; its base is built from a fixed seed (as
    ``from_pretrained`` would load it: the same weights whatever the run). ``alter``: add 1 to one
    element of that frozen weight (a changed base)."""

    def __init__(self, alter: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        state = torch.random.get_rng_state()
        torch.manual_seed(BASE_SEED)
        config = LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
        self.model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        torch.random.set_rng_state(state)
        if alter is not None:
            with torch.no_grad():
                dict(self.named_parameters())[alter].view(-1)[0] += 1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def token_batches() -> Any:
    """4 sequences: one step per epoch on 2 ranks (two on one), the same on every rank."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randint(0, 128, (4, 12), generator=g)), batch_size=2)


def trainable_state_bytes(module: torch.nn.Module, world_size: int) -> int:
    """What the data files of a checkpoint without the frozen weights must hold: each trainable
    parameter and AdamW's two moments of it (fp32), as each rank's chunk, and one step count per
    parameter; each as DCP writes an item (``torch.save``'s bytes of it: its zip records cost
    about 1.5 KiB an item, more than these tiny adapters' values)."""
    from lightning_zero.engine.shards.partition import ChunkLayout

    def item(t: torch.Tensor) -> int:
        buffer = io.BytesIO()
        torch.save(t, buffer)
        return buffer.tell()

    total = 0
    for p in (p for p in module.parameters() if p.requires_grad):
        total += sum(3 * item(torch.empty(ChunkLayout(p.numel(), world_size).owned_numel(r))) for r in range(world_size))
        total += item(torch.tensor(1.0))
    return total


def file_bytes(path: str) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in Path(path).iterdir() if f.is_file()}


class _WeightsAtStart(Callback):
    """The full weights once a checkpoint is restored, before any step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with trainer.strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _strategy(name: str, **options: Any) -> Any:
    from datetime import timedelta

    from lightning_zero import ZeroStrategy

    return ZeroStrategy(**STAGES[name], timeout=timedelta(seconds=60), **options)


def _fit(name: str, epochs: int, ckpt_path: Optional[str] = None, alter: Optional[str] = None, callbacks: tuple = ()) -> tuple:
    from lightning_helpers import full_weights, make_trainer

    L.seed_everything(0, verbose=False)
    module = LoraLlama(alter=alter)
    trainer = make_trainer(_strategy(name, save_frozen=False), max_steps=-1, max_epochs=epochs, callbacks=list(callbacks))
    trainer.fit(module, token_batches(), ckpt_path=ckpt_path)
    return module, trainer, full_weights(module, trainer.strategy)


# ---- 2 ranks: every stage in one group ---------------------------------------------------------------
GROUP = CaseGroup(world_size=2)


def round_trip(ctx: RankContext, variant: str) -> dict[str, Any]:
    """Fit 2 epochs; fit 1, save without frozen weights, resume to 2: bitwise the same; a changed
    base refused at resume."""
    import lightning_zero  # noqa: F401 - registers the strategies in the rank

    _, _, uninterrupted = _fit(variant, 2)
    _, trainer, saved = _fit(variant, 1)
    path = os.path.join(ctx.tmpdir, variant)
    trainer.save_checkpoint(path)
    if ctx.rank == 0:
        torch.save(saved, os.path.join(ctx.tmpdir, f"{variant}_weights.pt"))
    _, _, resumed = _fit(variant, 2, ckpt_path=path)
    refused = error_of(lambda: _fit(variant, 2, ckpt_path=path, alter=ALTERED))
    return {
        "bitwise": sorted(k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])),
        "keys": sorted(uninterrupted) == sorted(resumed),
        "files": file_bytes(path),
        "refused": refused,
    }


for _name in STAGES:
    GROUP.case(round_trip, name=f"round_trip_{_name}", variant=_name)


@GROUP.case
def async_save(ctx: RankContext) -> list[str]:
    """An asynchronous save (async_save=True) leaves the frozen weights out the same way: the keys
    the checkpoint's DCP metadata holds."""
    from datetime import timedelta

    from lightning_helpers import make_trainer

    import lightning_zero
    from lightning_zero.checkpoint.storage import read_dcp_metadata

    L.seed_everything(0, verbose=False)
    strategy = lightning_zero.ZeroStrategy(stage=2, save_frozen=False, async_save=True, timeout=timedelta(seconds=60))
    trainer = make_trainer(strategy, max_steps=-1, max_epochs=1)
    trainer.fit(LoraLlama(), token_batches())
    path = os.path.join(ctx.tmpdir, "async")
    trainer.save_checkpoint(path)
    strategy.wait_for_checkpoint()
    return sorted(k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("model/"))


@GROUP.case
def other_stage(ctx: RankContext) -> list[str]:
    """zero1's checkpoint resumed at zero3 and zero3's at zero1: the saved weights at the start."""
    import lightning_zero  # noqa: F401 - registers the strategies in the rank

    mismatched = []
    for saved_by, resumed_by in (("zero1", "zero3"), ("zero3", "zero1")):
        start = _WeightsAtStart()
        _fit(resumed_by, 2, ckpt_path=os.path.join(ctx.tmpdir, saved_by), callbacks=(start,))
        saved = torch.load(os.path.join(ctx.tmpdir, f"{saved_by}_weights.pt"))
        mismatched += [f"{saved_by}->{resumed_by}: {k}" for k in saved if not torch.equal(saved[k], start.weights[k])]
    return mismatched


@GROUP.case
def fabric_round_trip(ctx: RankContext) -> dict[str, Any]:
    """Fabric, zero3, save_frozen=False: one step, save, a fresh module loads it (the same weights and
    the next step alike); one with a changed base is refused."""
    from datetime import timedelta

    from lightning.fabric import Fabric
    from multiprocess import ranks_started

    from lightning_zero import ZeroFabricStrategy

    def set_up(alter: Optional[str] = None) -> tuple:
        strategy = ZeroFabricStrategy(stage=3, save_frozen=False, timeout=timedelta(seconds=60))
        fabric = Fabric(accelerator="cpu", devices=ranks_started(), strategy=strategy)
        fabric.launch()
        llama = LoraLlama(alter=alter).model
        optimizer = torch.optim.AdamW([p for p in llama.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = fabric.setup(llama, optimizer)
        return fabric, model, optimizer

    def step(fabric: Any, model: Any, optimizer: Any) -> None:
        tokens = next(iter(token_batches()))[0]
        fabric.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()

    def weights(fabric: Any, model: Any) -> dict[str, torch.Tensor]:
        with fabric.strategy.summon_full_params(model):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    path = os.path.join(ctx.tmpdir, "fabric")
    fabric, model, optimizer = set_up()
    step(fabric, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    step(fabric, model, optimizer)
    expected = weights(fabric, model)
    fabric, model, optimizer = set_up()
    left = fabric.load(path, {"model": model, "optimizer": optimizer})
    step(fabric, model, optimizer)
    after = weights(fabric, model)
    fabric, model, optimizer = set_up(alter=ALTERED)
    refused = error_of(lambda: fabric.load(path, {"model": model, "optimizer": optimizer}))
    return {"left": left, "bitwise": sorted(k for k in expected if not torch.equal(expected[k], after[k])), "refused": refused}


# ---- 1 rank: a checkpoint saved by 2 resumed by 1 --------------------------------------------------
ONE_RANK = CaseGroup(world_size=1)


@ONE_RANK.case
def fewer_ranks(ctx: RankContext) -> list[str]:
    """zero3 with offload's checkpoint (2 ranks) resumed at zero2 on 1 rank: the saved weights at the start."""
    import lightning_zero  # noqa: F401 - registers the strategies in the rank

    start = _WeightsAtStart()
    _fit("zero2", 2, ckpt_path=os.path.join(ctx.tmpdir, "zero3_offload"), callbacks=(start,))
    saved = torch.load(os.path.join(ctx.tmpdir, "zero3_offload_weights.pt"))
    return [k for k in saved if not torch.equal(saved[k], start.weights[k])]


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("frozen")


@pytest.fixture(scope="module")
def results(shared_dir: Path) -> GroupResults:
    return GROUP.run(shared_dir)


@pytest.fixture(scope="module")
def one_rank_results(results: GroupResults, shared_dir: Path) -> GroupResults:
    return ONE_RANK.run(shared_dir)  # after the 2-rank group wrote its checkpoints


@pytest.mark.parametrize("name", list(STAGES))
def test_resume_is_bitwise_and_small(results: GroupResults, shared_dir: Path, name: str) -> None:
    from lightning_zero.checkpoint.storage import read_dcp_metadata

    for r in results[f"round_trip_{name}"]:
        assert r["keys"] and r["bitwise"] == [], r["bitwise"]
        # the data files: within 10% of the trainable state; beside them only bookkeeping (the
        # manifest, DCP's .metadata, meta.pt), none of it a weight
        data = sum(size for file, size in r["files"].items() if file.endswith(".distcp"))
        expected = trainable_state_bytes(LoraLlama(), world_size=2)
        assert abs(data - expected) <= 0.1 * expected, (data, expected)
        assert set(r["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "lightning_zero.json", "meta.pt"}
    saved = {k[len("model/") :] for k in read_dcp_metadata(str(shared_dir / name)).state_dict_metadata if k.startswith("model/")}
    assert saved == {n for n, p in LoraLlama().named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", list(STAGES))
def test_changed_base_is_refused_naming_it(results: GroupResults, name: str) -> None:
    for r in results[f"round_trip_{name}"]:
        assert "FrozenWeightsMismatchError" in r["refused"] and ALTERED in r["refused"] and "content differs" in r["refused"], r["refused"]


def test_async_save_leaves_them_out_too(results: GroupResults) -> None:
    trainable = sorted(f"model/{n}" for n, p in LoraLlama().named_parameters() if p.requires_grad)
    assert results["async_save"] == [trainable, trainable]


def test_resume_at_another_stage(results: GroupResults) -> None:
    for mismatched in results["other_stage"]:
        assert mismatched == []


def test_resume_at_another_world_size(one_rank_results: GroupResults) -> None:
    assert one_rank_results["fewer_ranks"] == [[]]


def test_fabric_round_trip(results: GroupResults) -> None:
    for r in results["fabric_round_trip"]:
        assert r["left"] == {"step": 1} and r["bitwise"] == [], r
        assert "FrozenWeightsMismatchError" in r["refused"] and ALTERED[len("model.") :] in r["refused"], r["refused"]


# ---- in this process: construction, load_from_checkpoint, verify, convert ---------------------------------
def test_save_frozen_is_checked_at_construction() -> None:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    for cls in (ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(TypeError, match="`save_frozen` must be True or False"):
            cls(save_frozen="no")
        with pytest.raises(ValueError, match='state_dict_type="sharded"'):
            cls(save_frozen=False, state_dict_type="full")


def _saved(shared_dir: Path, name: str = "zero3") -> dict[str, torch.Tensor]:
    return torch.load(shared_dir / f"{name}_weights.pt")


def test_load_from_checkpoint_keeps_the_module_base(results: GroupResults, shared_dir: Path) -> None:
    import lightning_zero  # noqa: F401 - reads directories in load_from_checkpoint

    loaded = LoraLlama.load_from_checkpoint(str(shared_dir / "zero3"))  # strict, as by default
    saved = _saved(shared_dir)
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match="content differs"):
        LoraLlama.load_from_checkpoint(str(shared_dir / "zero3"), alter=ALTERED)
    assert "on_load_checkpoint" not in LoraLlama.__dict__  # the hook is the class's own again


def _cli(*argv: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from lightning_zero.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_verify_reports_frozen_weights_left_out(results: GroupResults, shared_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_zero.checkpoint.frozen import digest
    from lightning_zero.checkpoint.manifest import Manifest

    code, out = _cli("verify", str(shared_dir / "zero1"), capsys=capsys)
    manifest = Manifest.read(shared_dir / "zero1")
    count = sum(1 for p in LoraLlama().parameters() if not p.requires_grad)
    assert code == 0 and f"frozen weights left out ({count} tensors, fingerprint {digest(manifest.frozen)})" in out, out
    # the fingerprint does not depend on the stage or the world size the checkpoint was saved at
    assert all(Manifest.read(shared_dir / name).frozen == manifest.frozen for name in STAGES)


def _frozen_base(prefix: str = "") -> dict[str, torch.Tensor]:
    return {n[len(prefix) :]: p.detach().clone() for n, p in LoraLlama().named_parameters() if not p.requires_grad}


def test_convert_with_and_without_base(results: GroupResults, shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import save_file

    from lightning_zero.checkpoint.frozen_merge import FROZEN_KEY

    src, saved = str(shared_dir / "zero2"), _saved(shared_dir, "zero2")
    code, out = _cli("convert", src, str(tmp_path / "none.ckpt"), capsys=capsys)
    assert code == 2 and "--base" in out and "--trainable-only" in out and not (tmp_path / "none.ckpt").exists(), out

    code, out = _cli("convert", src, str(tmp_path / "trainable.ckpt"), "--trainable-only", capsys=capsys)
    trainable = torch.load(tmp_path / "trainable.ckpt", weights_only=False)
    frozen = _frozen_base()
    assert code == 0 and FROZEN_KEY in trainable and not set(frozen) & set(trainable["state_dict"]), out

    torch.save(frozen, tmp_path / "base.pt")
    save_file(_frozen_base("model."), str(tmp_path / "base.safetensors"))  # names without the prefix
    for base in (["--base", str(tmp_path / "base.pt")], ["--base", str(tmp_path), "--base-prefix", "model."]):
        code, out = _cli("convert", src, str(tmp_path / "full.ckpt"), *base, capsys=capsys)
        full = torch.load(tmp_path / "full.ckpt", weights_only=False)
        assert code == 0 and FROZEN_KEY not in full, out
        assert sorted(full["state_dict"]) == sorted(saved) and all(torch.equal(saved[k], full["state_dict"][k]) for k in saved)

    # --format safetensors: the base merged in the same way, names as Hugging Face's (--strip-prefix)
    from safetensors.torch import load_file

    code, out = _cli("convert", src, str(tmp_path / "hf"), "--format", "safetensors", "--strip-prefix", "model.", capsys=capsys)
    assert code == 2 and "--base" in out, out
    code, out = _cli(
        "convert", src, str(tmp_path / "hf"), "--format", "safetensors", "--strip-prefix", "model.", "--base", str(tmp_path / "base.pt"),
        capsys=capsys,
    )  # fmt: skip
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert code == 0 and sorted(exported) == sorted(k[len("model.") :] for k in saved), out
    assert all(torch.equal(saved["model." + k], v) for k, v in exported.items())

    missing = dict(frozen)
    del missing[ALTERED]
    torch.save(missing, tmp_path / "missing.pt")
    code, out = _cli("convert", src, str(tmp_path / "bad.ckpt"), "--base", str(tmp_path / "missing.pt"), capsys=capsys)
    assert code == 2 and f"{ALTERED}: missing" in out and "--base-prefix" in out, out

    reshaped = dict(frozen, **{ALTERED: frozen[ALTERED][:, :3].clone()})
    torch.save(reshaped, tmp_path / "reshaped.pt")
    code, out = _cli("convert", src, str(tmp_path / "bad.ckpt"), "--base", str(tmp_path / "reshaped.pt"), capsys=capsys)
    assert code == 2 and f"{ALTERED}: shape [32, 3], saved with [32, 64]" in out and not (tmp_path / "bad.ckpt").exists(), out
    code, out = _cli(
        "convert", src, str(tmp_path / "hf"), "--format", "safetensors", "--strip-prefix", "model.", "--base", str(tmp_path / "reshaped.pt"),
        capsys=capsys,
    )  # fmt: skip
    assert code == 2 and f"{ALTERED}: shape [32, 3], saved with [32, 64]" in out, out

    retyped = dict(frozen, **{ALTERED: frozen[ALTERED].double()})
    torch.save(retyped, tmp_path / "retyped.pt")
    code, out = _cli("convert", src, str(tmp_path / "bad.ckpt"), "--base", str(tmp_path / "retyped.pt"), capsys=capsys)
    assert code == 2 and f"{ALTERED}: dtype torch.float64, saved with torch.float32" in out, out


def test_fingerprint_is_split_independent() -> None:
    """The checksum of a tensor is the sum of its pieces' parts, however it is split."""
    from lightning_zero.checkpoint.frozen import MODULUS, checksum, partial_checksum

    for t in (torch.randn(1001), torch.randn(37).bfloat16(), torch.arange(10, dtype=torch.int64), torch.rand(9) > 0.5):
        whole = checksum(t)
        for parts in (2, 3, 7):
            pieces = torch.chunk(t, parts)
            starts = [sum(p.numel() for p in pieces[:i]) for i in range(len(pieces))]
            assert sum(partial_checksum(p, s) for p, s in zip(pieces, starts)) % MODULUS == whole
    # the definition, in Python integers: sum((i + 1) * bits(x_i)) mod P, bits the element's signed int view
    for t in (torch.randn(50), torch.randn(50).double(), torch.randn(50).half()):
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()
        assert checksum(t) == sum((i + 1) * b for i, b in enumerate(bits)) % MODULUS
    assert partial_checksum(torch.ones(4), MODULUS - 2) == sum((MODULUS - 1 + i) * 0x3F800000 for i in range(4)) % MODULUS
    kept = torch.arange(5, dtype=torch.int64)
    checksum(kept)
    assert torch.equal(kept, torch.arange(5))  # the checksum never writes into what it reads
    a = torch.randn(64)
    b = a.clone()
    b[[3, 4]] = b[[4, 3]]  # a swap changes it
    assert checksum(a) != checksum(b)


def test_fingerprint_parts_are_summed_again_only_after_the_weights_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank sums a frozen weight once per run: again only after a load or an in-place edit (its
    version counter), never for a save that follows a save."""
    from lightning_zero.checkpoint import frozen

    summed: list[int] = []
    real = frozen.partial_checksum
    monkeypatch.setattr(frozen, "partial_checksum", lambda values, start: summed.append(values.numel()) or real(values, start))
    module = torch.nn.Linear(8, 4)
    module.requires_grad_(False)
    first = frozen.fingerprint(module, None, None, frozen.frozen_names(module))
    assert frozen.fingerprint(module, None, None, frozen.frozen_names(module)) == first and len(summed) == 2
    with torch.no_grad():
        module.weight.mul_(2)  # an edit through the parameter moves its version counter
    edited = frozen.fingerprint(module, None, None, frozen.frozen_names(module))
    assert len(summed) == 3 and edited["weight"]["checksum"] != first["weight"]["checksum"]
    assert edited["weight"]["checksum"] == frozen.checksum(module.weight) and edited["bias"] == first["bias"]

"""``export_safetensors`` / ``lightning-zero convert --format safetensors``: a tiny Llama (transformers,
built from a config, nothing downloaded) in a LightningModule, fitted on 2 CPU ranks at zero1
(untied, split into several files) and zero3 (tied embeddings, one file; also saved to and exported
from a moto S3 server when moto is installed), exported and loaded with ``from_pretrained``: logits
equal to the trained module's, bit for bit in fp32. Re-exporting over an export (its config kept, its
old files gone), ``--dtype``, and the bad inputs: no safetensors package, a prefix that maps no name,
a missing shard file, a destination that is not ours, options of the other format, a failure that
leaves the earlier export as it was."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext

pytest.importorskip("transformers", reason="transformers builds the Llama these tests export")
pytest.importorskip("safetensors", reason="safetensors writes the export")

HAS_MOTO = importlib.util.find_spec("moto") is not None and importlib.util.find_spec("s3fs") is not None
GROUP = CaseGroup(world_size=2, timeout=150)
BUCKET = "s3://bucket"
TOKENS = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(3))
"""The prompt both models' logits are compared on."""


def _llama_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )


def _llama_module(tie: bool) -> Any:
    """A LightningModule holding the Llama as ``self.model``: its keys are ``model.model.layers...``."""
    import lightning as L
    from transformers import LlamaForCausalLM

    class LlamaModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(_llama_config(tie))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return LlamaModule()


def _fit_and_save(ctx: RankContext, stage: int, tie: bool, name: str, url: str = "") -> tuple[dict[str, torch.Tensor], str]:
    """3 steps at ``stage``, saved to ``<tmpdir>/<name>`` (and ``url``); the trained weights, in full."""
    import lightning as L
    from lightning_helpers import full_weights, make_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    L.seed_everything(0, verbose=False)
    module = _llama_module(tie)
    data = DataLoader(TensorDataset(torch.randint(0, 128, (12, 8), generator=torch.Generator().manual_seed(1))), batch_size=2)
    trainer = make_trainer(ZeroStrategy(stage=stage), max_steps=3)
    trainer.fit(module, data)
    path = os.path.join(ctx.tmpdir, name)
    trainer.save_checkpoint(path)
    if url:
        trainer.save_checkpoint(url)
    return full_weights(module, trainer.strategy), path


def _logits_equal(weights: dict[str, torch.Tensor], out_dir: Path, tie: bool) -> bool:
    """The Llama with the trained weights and the one ``from_pretrained`` reads from ``out_dir``: the
    same logits, bit for bit."""
    from transformers import LlamaForCausalLM

    trained = LlamaForCausalLM(_llama_config(tie)).eval()
    trained.load_state_dict({k[len("model.") :]: v for k, v in weights.items()})
    exported = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.equal(trained(TOKENS).logits, exported(TOKENS).logits)


def _hugging_face_split(weights: dict[str, torch.Tensor], max_shard_size: int) -> dict[str, str]:
    """Which file ``save_pretrained`` puts each tensor of the Llama in (huggingface_hub's split)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {k[len("model.") :]: v for k, v in weights.items()}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    return split.tensor_to_filename


def _files(out_dir: Path) -> list[str]:
    return sorted(os.listdir(out_dir))


@GROUP.case
def zero1_untied_several_files(ctx: RankContext) -> dict[str, Any]:
    """Exported in files of at most 20 kB (the model is ~110 kB), with a config; exported again over
    that folder as one bf16 file."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import export_safetensors

    weights, path = _fit_and_save(ctx, stage=1, tie=False, name="zero1.ckpt")
    if ctx.rank != 0:
        return {}
    out = Path(ctx.tmpdir, "zero1_hf")
    config = Path(ctx.tmpdir, "zero1_config")
    _llama_config(tie=False).save_pretrained(config)
    exported = export_safetensors(path, out, strip_prefix="model.", max_shard_size=20_000, config=config / "config.json")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = {name: load_file(out / name) for name in sorted(set(index["weight_map"].values()))}
    shard_bytes = [sum(t.numel() * t.itemsize for t in shard.values()) for shard in shards.values()]
    written = {k: t for shard in shards.values() for k, t in shard.items()}
    result = {
        "path": path,
        "files": _files(out),
        "exported_files": exported.files,
        "index_total_size": index["metadata"]["total_size"],
        "total_size": exported.total_size,
        "shard_bytes": shard_bytes,
        "split_as_hugging_face": _hugging_face_split(weights, 20_000) == index["weight_map"],
        "weights_equal": sorted(written) == sorted(k[len("model.") :] for k in weights)
        and all(torch.equal(written[k[len("model.") :]], v) for k, v in weights.items()),
        "logits_equal": _logits_equal(weights, out, tie=False),
    }
    again = export_safetensors(path, out, strip_prefix="model.", dtype="bf16")
    bf16 = load_file(out / "model.safetensors")
    result["again_files"] = _files(out)
    result["again_total_size"] = again.total_size
    result["bf16_equal"] = all(torch.equal(bf16[k[len("model.") :]], v.to(torch.bfloat16)) for k, v in weights.items())
    return result


@GROUP.case
def zero3_tied(ctx: RankContext) -> dict[str, Any]:
    """Tied embeddings at stage 3, exported to one file (and, with moto, saved to S3 and exported from there)."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import export_safetensors

    url = f"{BUCKET}/zero3.ckpt" if os.environ.get("AWS_ENDPOINT_URL") else ""
    weights, path = _fit_and_save(ctx, stage=3, tie=True, name="zero3.ckpt", url=url)
    if ctx.rank != 0:
        return {}
    out = Path(ctx.tmpdir, "zero3_hf")
    exported = export_safetensors(path, out, strip_prefix="model.")
    _llama_config(tie=True).save_pretrained(out)
    written = load_file(out / "model.safetensors")
    result = {
        "path": path,
        "files": _files(out),
        "tied": exported.tied,
        "written": sorted(written),
        "logits_equal": _logits_equal(weights, out, tie=True),
    }
    if url:
        from_s3 = export_safetensors(url, Path(ctx.tmpdir, "zero3_hf_from_s3"), strip_prefix="model.")
        again = load_file(from_s3.out_dir / "model.safetensors")
        result["s3_equal"] = sorted(again) == sorted(written) and all(torch.equal(again[k], written[k]) for k in written)
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    server = None
    if HAS_MOTO:
        from s3_server import S3Server

        server = S3Server(str(tmp_path_factory.mktemp("s3"))).start()  # its endpoint reaches the ranks through the environment
    try:
        yield GROUP.run(tmp_path_factory.mktemp("export"))
    finally:
        if server is not None:
            server.stop()


# ---- from_pretrained reads the export --------------------------------------------------------------
def test_zero1_export_in_several_files_loads_with_from_pretrained(results):
    out = results["zero1_untied_several_files"][0]
    shards = [f for f in out["files"] if f.endswith(".safetensors")]
    assert len(shards) >= 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", out["files"]
    assert out["files"] == sorted([*shards, "model.safetensors.index.json", "config.json"])
    assert out["exported_files"] == [*shards, "model.safetensors.index.json"]
    assert out["index_total_size"] == out["total_size"] == sum(out["shard_bytes"])
    assert all(size <= 20_000 for size in out["shard_bytes"])
    assert out["split_as_hugging_face"]  # the same files, holding the same tensors, as save_pretrained's
    assert out["weights_equal"]
    assert out["logits_equal"]


def test_exporting_over_an_export_replaces_its_weights_and_keeps_its_config(results):
    out = results["zero1_untied_several_files"][0]
    assert out["again_files"] == ["config.json", "model.safetensors"]  # the old files and index gone
    assert out["again_total_size"] * 2 == out["total_size"]  # bf16
    assert out["bf16_equal"]


def test_zero3_tied_embeddings_are_written_once_and_tied_back_on_loading(results):
    out = results["zero3_tied"][0]
    assert out["files"] == ["config.json", "model.safetensors"]
    assert out["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in out["written"] and "model.embed_tokens.weight" in out["written"]
    assert out["logits_equal"]


@pytest.mark.skipif(not HAS_MOTO, reason="moto[server] and s3fs (the `test` extra) run the S3 server")
def test_export_from_a_checkpoint_in_a_bucket(results):
    assert results["zero3_tied"][0]["s3_equal"]


# ---- bad input -------------------------------------------------------------------------------------
def test_missing_safetensors_package_is_named_with_its_pip_command(results, tmp_path, monkeypatch):
    from lightning_zero.checkpoint import export_safetensors

    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors...` raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"needs the `safetensors` package.*pip install safetensors"):
        export_safetensors(results["zero1_untied_several_files"][0]["path"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_prefix_that_maps_no_name_lists_the_names_present(results, tmp_path):
    from lightning_zero.checkpoint import export_safetensors

    listed = r"strip_prefix 'encoder\.' maps no name .* its names are 'model\.model\.embed_tokens\.weight', .* and \d+ more"
    with pytest.raises(ValueError, match=listed):
        export_safetensors(results["zero1_untied_several_files"][0]["path"], tmp_path / "out", strip_prefix="encoder.")
    assert os.listdir(tmp_path) == []


def test_a_missing_shard_file_is_named(results, tmp_path):
    from lightning_zero.checkpoint import CorruptCheckpointError, export_safetensors

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(results["zero3_tied"][0]["path"], damaged)
    (damaged / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"is damaged: __1_0\.distcp is missing"):
        export_safetensors(damaged, tmp_path / "out", strip_prefix="model.")
    assert not (tmp_path / "out").exists()


def test_a_destination_the_export_did_not_write_is_refused(results, tmp_path):
    from lightning_zero.checkpoint import export_safetensors

    src = results["zero1_untied_several_files"][0]["path"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not an earlier lightning-zero export"):
        export_safetensors(src, foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        export_safetensors(src, tmp_path / "a_file")
    with pytest.raises(ValueError, match="is inside the checkpoint"):
        export_safetensors(src, src)  # the checkpoint itself
    with pytest.raises(ValueError, match="is inside the checkpoint"):
        export_safetensors(src, Path(src, "hf"))
    with pytest.raises(ValueError, match="must be a local path, got the URL 's3://bucket/hf'"):
        export_safetensors(src, "s3://bucket/hf")
    with pytest.raises(ValueError, match="dtype 'int8' is not one the export writes; give one of 'bf16', 'fp16', 'fp32'"):
        export_safetensors(src, tmp_path / "out", dtype="int8")


def test_a_failed_export_leaves_the_earlier_one_as_it_was(results, tmp_path, monkeypatch):
    import safetensors.torch

    from lightning_zero.checkpoint import CheckpointWriteError, export_safetensors

    src, out = results["zero1_untied_several_files"][0]["path"], tmp_path / "hf"
    export_safetensors(src, out, strip_prefix="model.", max_shard_size=40_000)
    before = {name: (out / name).read_bytes() for name in _files(out)}
    written = []

    def full_disk(tensors: Any, filename: str, metadata: Any = None) -> None:
        if written:
            raise OSError(28, "No space left on device")
        written.append(filename)
        real_save_file(tensors, filename, metadata=metadata)

    real_save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"hf' could not be written: No space left on device"):
        export_safetensors(src, out, strip_prefix="model.", max_shard_size=20_000)
    assert {name: (out / name).read_bytes() for name in _files(out)} == before
    assert _files(tmp_path) == ["hf"]  # no temporary folder left


# ---- the command line --------------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from lightning_zero.cli import main

    try:
        status = main(["convert", *argv])
    except SystemExit as exited:
        status = exited.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_exports_with_every_option(results, tmp_path, capsys):
    from safetensors import safe_open

    _llama_config(tie=True).save_pretrained(tmp_path / "config")
    src, out = results["zero3_tied"][0]["path"], tmp_path / "hf"
    status, stdout, stderr = _cli(
        capsys, src, str(out), "--format", "safetensors", "--strip-prefix", "model.", "--max-shard-size", "30KB",
        "--dtype", "fp16", "--config", str(tmp_path / "config" / "config.json"),
    )  # fmt: skip
    assert status == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith(f"wrote {out} (2 safetensors files and an index, ") and lines[0].endswith(" of weights)"), stdout
    assert lines[1] == "tied, written once: lm_head.weight (as model.embed_tokens.weight)"
    assert "config.json" in _files(out) and "model.safetensors.index.json" in _files(out)
    with safe_open(str(out / "model-00001-of-00002.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
        assert f.metadata()["format"] == "pt"


def test_cli_refuses_options_of_the_other_format(results, tmp_path, capsys):
    src = results["zero1_untied_several_files"][0]["path"]
    status, _, stderr = _cli(capsys, src, str(tmp_path / "out.ckpt"), "--strip-prefix", "model.", "--dtype", "bf16")
    assert status == 2 and "error: --strip-prefix, --dtype only applies with --format safetensors (this is --format lightning)" in stderr
    status, _, stderr = _cli(capsys, src, str(tmp_path / "hf"), "--format", "safetensors", "--with-optimizer")
    assert status == 2 and "error: --with-optimizer only applies with --format lightning (this is --format safetensors)" in stderr
    status, _, stderr = _cli(capsys, src, str(tmp_path / "hf"), "--format", "safetensors", "--max-shard-size", "big")
    assert status == 2 and "'big' has an unknown unit" in stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "out.ckpt").exists()


def test_cli_errors_are_one_line(results, tmp_path, capsys, monkeypatch):
    src = results["zero1_untied_several_files"][0]["path"]
    status, _, stderr = _cli(capsys, src, str(tmp_path / "hf"), "--format", "safetensors", "--strip-prefix", "encoder.")
    assert status == 2 and stderr.startswith("lightning-zero convert: error: strip_prefix 'encoder.' maps no name") and stderr.count("\n") == 1
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    status, _, stderr = _cli(capsys, src, str(tmp_path / "hf"), "--format", "safetensors")
    assert status == 2 and stderr.endswith("pip install safetensors\n") and stderr.count("\n") == 1


def test_weights_the_checkpoint_lacks_come_from_base(results, tmp_path):
    """A manifest naming a parameter that no shard holds (as a save without frozen weights would):
    refused, naming it, unless ``base`` gives it."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import CorruptCheckpointError, export_safetensors

    src = tmp_path / "lacking.ckpt"
    shutil.copytree(results["zero1_untied_several_files"][0]["path"], src)
    manifest = json.loads((src / "lightning_zero.json").read_text())
    manifest["params"]["model.extra.weight"] = [2, 3]
    (src / "lightning_zero.json").write_text(json.dumps(manifest))
    lacking = r"lists 'model\.extra\.weight' in its manifest but holds no tensor for it; pass the weights it lacks as `base`"
    with pytest.raises(CorruptCheckpointError, match=lacking):
        export_safetensors(src, tmp_path / "hf", strip_prefix="model.")
    base = {"extra.weight": torch.ones(2, 3, dtype=torch.float64)}
    export_safetensors(src, tmp_path / "hf", strip_prefix="model.", base=base, dtype="fp32")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(written["extra.weight"], torch.ones(2, 3)) and len(written) == 22  # 21 of the Llama

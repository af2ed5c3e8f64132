"""The Hugging Face and LitGPT examples, each run as its command line would (LightningCLI; LitGPT's
`pretrain.main`) with its config at tiny sizes, under zero3 and under DDP in one group of 2 CPU ranks:
the same losses and weights, the `save_pretrained` export loading back as the trained model, and
LitGPT's resume from a sharded checkpoint continuing exactly as the uninterrupted run."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from example_runs import EXAMPLES, REPO

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
INSTALL = "pip install -e '.[examples]'"
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason=f"transformers is not installed: {INSTALL}")
needs_litgpt = pytest.mark.skipif(not HAS_LITGPT, reason=f"litgpt is not installed: {INSTALL}")

GROUP = CaseGroup(world_size=2)

# Float rounding only: the clipping norm is summed from shards (as in test_fabric.py) and, with
# accumulation, stage 3 reduces each micro-batch's gradient where DDP reduces their sum. Measured
# after these 4 steps: losses within 4.8e-7 (one float32 ulp at 5.5), weights within 3e-7.
LOSS_ATOL = 1e-6
WEIGHT_ATOL = 2e-6


def _examples_importable() -> None:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download


# ---- Hugging Face: examples/hf_causal_lm.py with configs/hf_zero3.yaml -------------------------------
# 2 GPT-2 blocks of 32 (tied embeddings, GPT-2's dropout), 4 steps with clipping, validation after
# steps 2 and 4.
HF_TINY = [
    "--model.config.n_layer=2",
    "--model.config.n_head=2",
    "--model.config.n_embd=32",
    "--model.config.n_positions=32",
    "--model.warmup_steps=2",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=50000",
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def hf_fit(ctx: RankContext, strategy: str) -> dict[str, Any]:
    """`hf_causal_lm.py fit --config configs/hf_zero3.yaml` (tiny) under `strategy`: the full weights
    after fit (gathered on every rank) and where the metrics and the exported model are."""
    _examples_importable()
    import hf_causal_lm

    run_dir = Path(ctx.tmpdir, f"hf_{strategy}")
    cli = hf_causal_lm.main([
        "fit",
        f"--config={REPO / 'configs' / 'hf_zero3.yaml'}",
        f"--trainer.strategy={strategy}",
        *HF_TINY,
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={run_dir}",
        f"--save_pretrained={run_dir / 'hf_model'}",
    ])  # fmt: skip
    model, trainer = cli.model.model, cli.trainer
    summon = getattr(trainer.strategy, "summon_full_params", None)  # DDP holds the full weights anyway
    with summon() if summon is not None else contextlib.nullcontext():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx.kept[strategy] = weights
    return {"weights": weights, "metrics": trainer.logger.log_dir}


def hf_reload(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 loads each run's `save_pretrained` directory with `from_pretrained`: whether every weight
    equals the trained one, and whether GPT-2's output layer is tied to its input embedding again."""
    if ctx.rank != 0:
        return {}
    from transformers import AutoModelForCausalLM

    out = {}
    for strategy in ("ddp", "zero3"):
        loaded = AutoModelForCausalLM.from_pretrained(Path(ctx.tmpdir, f"hf_{strategy}", "hf_model"))
        state, trained = loaded.state_dict(), ctx.kept[strategy]
        out[strategy] = {
            "n_layer": loaded.config.n_layer,
            "tied": loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr(),
            "same_keys": state.keys() == trained.keys(),
            "differing": sorted(key for key, value in trained.items() if not torch.equal(state[key], value)),
        }
    return out


# ---- LitGPT: examples/litgpt_pretrain.py with configs/litgpt_pretrain.yaml ---------------------------
# 2 Llama-style blocks of 32, micro-batches of 2 accumulated twice on each of 2 ranks, 4 optimizer
# steps (8 iterations), clipping at 1.0, validation and a sharded checkpoint every 2 steps.
LITGPT_TINY = [
    "--model_config.n_embd=32",
    "--model_config.intermediate_size=88",
    "--model_config.block_size=32",
    "--train.micro_batch_size=2",
    "--train.global_batch_size=8",
    "--train.max_tokens=1024",  # 8 iterations x 2 ranks x 2 sequences x 32 tokens
    "--train.log_interval=1",
    "--train.save_interval=2",
    "--train.lr_warmup_steps=2",
    "--eval.interval=2",
    "--eval.max_iters=2",
    "--data.init_args.max_bytes=50000",
]


def litgpt_pretrain(ctx: RankContext, strategy: str, out: str, save: bool = True, resume_from: str = "") -> str:
    """`litgpt_pretrain.py --config configs/litgpt_pretrain.yaml` (tiny) under `strategy`; its out_dir."""
    _examples_importable()
    # LitGPT's main() compiles the model with inductor: 45-85 s per tiny run on 2 busy cores. Compiled,
    # these runs were checked by hand (zero3 against DDP: losses within 4.8e-7, weights 1.2e-7), and
    # compiled modules are compared with compiled DDP at every stage in test_fabric.py.
    import litgpt_pretrain

    out_dir = Path(ctx.tmpdir, out)
    resume = [f"--resume={Path(ctx.tmpdir, resume_from, 'step-00000002', 'lit_model.pth')}"] if resume_from else []
    # LitGPT writes hyperparameters.yaml with each checkpoint (~0.5 s of jsonargparse): the runs that
    # need no checkpoint on the way save the final one only
    saves = [] if save else ["--train.save_interval=null"]
    with torch._dynamo.config.patch(disable=True):
        litgpt_pretrain.main([
            f"--config={REPO / 'configs' / 'litgpt_pretrain.yaml'}",
            f"--strategy={strategy}",
            *LITGPT_TINY,
            f"--out_dir={out_dir}",
            *saves,
            *resume,
        ])  # fmt: skip
    return str(out_dir)


if HAS_TRANSFORMERS:
    GROUP.case(name="hf_ddp", fn=hf_fit, strategy="ddp")
    GROUP.case(name="hf_zero3", fn=hf_fit, strategy="zero3")
    GROUP.case(name="hf_reload", fn=hf_reload)
if HAS_LITGPT:
    GROUP.case(name="litgpt_ddp", fn=litgpt_pretrain, strategy="ddp", out="litgpt_ddp", save=False)
    GROUP.case(name="litgpt_zero3", fn=litgpt_pretrain, strategy="zero3", out="litgpt_zero3")
    # a fresh run that resumes from the zero3 run's checkpoint after step 2 (of 4)
    GROUP.case(
        name="litgpt_zero3_resumed", fn=litgpt_pretrain,
        strategy="zero3", out="litgpt_resumed", save=False, resume_from="litgpt_zero3",
    )  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    if not GROUP.cases:
        pytest.skip(f"neither transformers nor litgpt is installed: {INSTALL}")
    return GROUP.run(tmp_path_factory.mktemp("examples"))


def _metrics(path: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every row of `path`/metrics.csv that logged `key`."""
    with open(path / "metrics.csv") as rows:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(rows) if row.get(key)]


def _litgpt_logs(out_dir: Path) -> Path:
    return out_dir / "logs" / "csv" / "version_0"  # LitGPT's CSVLogger (logger_name: csv)


def _assert_close(ours: list[tuple[int, float]], ddp: list[tuple[int, float]], what: str) -> None:
    assert ours and [step for step, _ in ours] == [step for step, _ in ddp], what
    for (step, a), (_, b) in zip(ours, ddp):
        assert a == pytest.approx(b, abs=LOSS_ATOL, rel=0), f"{what} at step {step}: {a} vs DDP's {b}"


def _assert_weights_close(ours: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor], atol: float) -> None:
    assert ours.keys() == ddp.keys()
    for key, value in ddp.items():
        diff = (ours[key].float() - value.float()).abs().max().item()
        assert diff <= atol, f"{key} differs from DDP's by {diff}"


@needs_transformers
def test_hf_causal_lm_under_zero3_matches_ddp(results: GroupResults) -> None:
    ours, ddp = results["hf_zero3"][0], results["hf_ddp"][0]
    for key in ("train_loss", "val_loss"):
        _assert_close(_metrics(Path(ours["metrics"]), key), _metrics(Path(ddp["metrics"]), key), key)
    assert len(_metrics(Path(ours["metrics"]), "train_loss")) == 4
    for rank_ours, rank_ddp in zip(results["hf_zero3"], results["hf_ddp"]):
        _assert_weights_close(rank_ours["weights"], rank_ddp["weights"], WEIGHT_ATOL)


@needs_transformers
def test_hf_save_pretrained_loads_back_as_the_trained_model(results: GroupResults) -> None:
    for strategy, loaded in results["hf_reload"][0].items():
        assert loaded["n_layer"] == 2, strategy
        assert loaded["tied"], f"{strategy}: GPT-2's output layer is no longer tied to its input embedding"
        assert loaded["same_keys"] and loaded["differing"] == [], strategy


@needs_litgpt
def test_litgpt_pretrain_under_zero3_matches_ddp(results: GroupResults) -> None:
    from lightning_zero.checkpoint import full_checkpoint

    ours, ddp = (Path(results[case][0]) for case in ("litgpt_zero3", "litgpt_ddp"))
    for key in ("loss", "val_loss"):
        _assert_close(_metrics(_litgpt_logs(ours), key), _metrics(_litgpt_logs(ddp), key), key)
    assert len(_metrics(_litgpt_logs(ours), "loss")) == 4  # one per optimizer step: the mean of its 2 micro-batches
    final = "final/lit_model.pth"
    assert (ours / final).is_dir() and (ours / "step-00000002" / "lit_model.pth").is_dir(), "sharded checkpoints"
    ddp_weights = torch.load(ddp / final, weights_only=True)["model"]
    _assert_weights_close(full_checkpoint(ours / final)["state_dict"], ddp_weights, WEIGHT_ATOL)


@needs_litgpt
def test_litgpt_resume_from_a_sharded_checkpoint_continues_exactly(results: GroupResults) -> None:
    from lightning_zero.checkpoint import full_checkpoint

    uninterrupted, resumed = (Path(results[case][0]) for case in ("litgpt_zero3", "litgpt_zero3_resumed"))
    for key in ("loss", "val_loss"):  # logged at iteration - 1: steps 3 and 4 end at iterations 6 and 8
        expected = [(step, value) for step, value in _metrics(_litgpt_logs(uninterrupted), key) if step >= 4]
        assert expected and _metrics(_litgpt_logs(resumed), key) == expected, key  # bitwise
    a = full_checkpoint(uninterrupted / "final" / "lit_model.pth", include_optimizer=True)
    b = full_checkpoint(resumed / "final" / "lit_model.pth", include_optimizer=True)
    assert (a["iter_num"], a["step_count"]) == (b["iter_num"], b["step_count"]) == (8, 4)
    for key, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][key], value), key
    for index, state in a["optimizer_states"][0]["state"].items():
        for name, tensor in state.items():
            assert torch.equal(b["optimizer_states"][0]["state"][index][name], tensor), (index, name)

"""The big-model configs (configs/big_models/) and the example's options behind them, each checked for
what it is for: meta init builds on the meta device at stage 3 and trains to DDP's weights; activation
checkpointing keeps fewer tensors for backward and trains to the same weights; compiling each block
leaves zero3's hooks outside the graphs; offload leaves no model state on the device. Each config's
own options are read from its YAML, with a tiny model; the four also run stacked through the CLI."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
import yaml
from case_groups import CaseGroup, GroupResults, RankContext
from example_runs import EXAMPLES, REPO, run_example_in_rank

CONFIGS = REPO / "configs" / "big_models"
FEATURES = ("meta_init", "activation_checkpointing", "compile", "offload")
STEPS = 3
SHAPE = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)  # 2 blocks: two stage-3 units besides the root


def _config(feature: str) -> dict:
    with open(CONFIGS / f"{feature}.yaml") as f:
        return yaml.safe_load(f)


def _strategy(feature: str):
    """The config's strategy, as a string name or a constructed ZeroStrategy."""
    strategy = _config(feature)["trainer"]["strategy"]
    if isinstance(strategy, str):
        return strategy
    import lightning_zero

    assert strategy["class_path"] == "lightning_zero.ZeroStrategy"
    return lightning_zero.ZeroStrategy(**strategy["init_args"])


def _example_module(**options):
    from train_gpt import GPTLightningModule

    class Probed(GPTLightningModule):
        """Records whether `configure_model` built the GPT on the meta device."""

        built_on_meta = None

        def configure_model(self) -> None:
            built_here = self.model is None
            super().configure_model()
            if built_here:
                self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    return Probed(**SHAPE, **options)


def fit_example(ctx: RankContext, strategy, model_options: dict) -> dict:
    """Fit the example's module for STEPS steps; its weights before the first step and after each."""
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer
    from stdlib_corpus import StdlibCorpus
    from torch._dynamo.utils import counters

    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    class Recorder(WeightRecorder):
        memory = None
        all_gathers: list[int] = []  # this process's count after each step

        def on_train_start(self, trainer, pl_module) -> None:
            self.on_train_batch_end(trainer, pl_module)  # the initial weights

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            super().on_train_batch_end(trainer, pl_module, *args)
            if hasattr(trainer.strategy, "memory_report"):
                self.memory = trainer.strategy.memory_report()
            self.all_gathers = [*self.all_gathers, COLLECTIVE_STATS.calls["all_gather"]]

    L.seed_everything(1234, verbose=False)
    torch._dynamo.reset()
    counters.clear()
    module = _example_module(**model_options)
    recorder = Recorder()
    data = StdlibCorpus(block_size=SHAPE["block_size"], batch_size=4, max_bytes=50_000)
    strategy = _strategy(strategy) if strategy in FEATURES else strategy
    make_trainer(strategy, STEPS, callbacks=[recorder]).fit(module, data)
    return {
        "history": recorder.history,
        "built_on_meta": module.built_on_meta,
        "memory": recorder.memory,
        "all_gathers_per_step": [b - a for a, b in zip(recorder.all_gathers, recorder.all_gathers[1:])],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _model_options(feature: str) -> dict:
    return _config(feature).get("model", {})


GROUP = CaseGroup(world_size=2, timeout=300)
# the references: the default model (eager, legacy init) and the meta-init model, both under DDP
GROUP.case(fit_example, name="ddp", strategy="ddp", model_options={})
GROUP.case(fit_example, name="ddp_meta_init", strategy="ddp", model_options=_model_options("meta_init"))
for _feature in FEATURES:
    GROUP.case(fit_example, name=_feature, strategy=_feature, model_options=_model_options(_feature))


@GROUP.case
def stacked_in_the_cli(ctx: RankContext) -> str:
    """All four configs at once (`--config` repeated) through the example's CLI, with a tiny model;
    the run's log directory."""
    run_dir = run_example_in_rank(
        Path(ctx.tmpdir, "stacked"),
        *(f"--config={CONFIGS / f'{feature}.yaml'}" for feature in FEATURES),
        *(f"--model.{key}={value}" for key, value in SHAPE.items() if key != "block_size"),
        f"--data.block_size={SHAPE['block_size']}",
        "--data.batch_size=4",
        "--data.max_bytes=50000",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=2",
        "--memory_monitor.every_n_steps=1",
    )
    return str(run_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))  # the ranks start with this sys.path: train_gpt, stdlib_corpus
        return GROUP.run(tmp_path_factory.mktemp("big_models"))


def _diffs(reference: list, run: list) -> list[float]:
    from lightning_helpers import max_abs_diff

    assert len(run) == len(reference) == STEPS + 1
    return [max_abs_diff(a, b) for a, b in zip(reference, run)]


def test_each_config_enables_its_feature_at_stage_3():
    assert _model_options("meta_init") == {"meta_init": True}
    assert _model_options("activation_checkpointing") == {"activation_checkpointing": True}
    assert _model_options("compile")["compile"] is True
    for feature in FEATURES:
        strategy = _strategy(feature)
        stage = strategy if isinstance(strategy, str) else f"zero{int(strategy.zero_config.stage)}"
        assert str(stage).startswith("zero3"), feature
    offload = _strategy("offload").zero_config
    assert offload.offload_optimizer and offload.offload_params and offload.fused_host_step


def test_meta_init_builds_on_the_meta_device_and_trains_as_the_same_model_under_ddp(results):
    for ddp, zero in zip(results["ddp_meta_init"], results["meta_init"]):
        assert zero["built_on_meta"] is True and ddp["built_on_meta"] is False
        assert _diffs(ddp["history"], zero["history"]) == [0.0] * (STEPS + 1)
    # a different start from the default build's (same distributions, drawn in another order)
    default, meta = results["ddp"][0]["history"][0], results["ddp_meta_init"][0]["history"][0]
    assert not torch.equal(default["model.blocks.0.attn.qkv.weight"], meta["model.blocks.0.attn.qkv.weight"])


@pytest.mark.parametrize("feature", ["activation_checkpointing", "compile"])
def test_checkpointing_and_compile_train_as_the_plain_model_under_ddp(results, feature):
    for ddp, zero in zip(results["ddp"], results[feature]):
        assert _diffs(ddp["history"], zero["history"]) == [0.0] * (STEPS + 1)


def test_checkpointing_recomputes_without_gathering_again(results):
    plain = results["meta_init"][0]["all_gathers_per_step"]  # zero3 without checkpointing, same units
    # the step's 5 (the root once, each of the 2 blocks in forward and again in backward) and the 3 of
    # the recorder's summon_full_params (every unit once)
    assert plain == [5 + 3] * STEPS
    for r in results["activation_checkpointing"]:
        assert r["all_gathers_per_step"] == plain


def test_compile_captures_one_graph_per_mode_without_breaks_at_stage_3(results):
    for r in results["compile"]:
        # the identical blocks share one graph (a second for validation's eval mode); zero3's hooks
        # run outside it, so nothing breaks it
        assert 1 <= r["graphs"] <= 2 and r["graph_breaks"] == 0, r


def test_offload_leaves_no_model_state_on_the_device(results):
    from lightning_zero.engine.memory import StateBytes

    zero3 = results["meta_init"][0]["memory"]  # stage 3 without offload, the same shapes
    for r in results["offload"]:
        memory = r["memory"]
        assert memory.device == StateBytes()
        assert memory.host.parameters == zero3.device.parameters > 0
        assert memory.host.optimizer_state == zero3.device.optimizer_state > 0
    for ddp, offload in zip(results["ddp"], results["offload"]):
        # the fused CPU AdamW kernel rounds differently from the configured one: float rounding only
        assert max(_diffs(ddp["history"], offload["history"])) <= 1e-6


def test_init_per_layer_draws_gpt2s_distributions_in_reset_parameters():
    """What a meta build relies on: materializing each module in order through its own
    `reset_parameters()` gives the eager build's weights, and those are GPT-2's."""
    from lightning_zero.models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, init_per_layer=True)
    torch.manual_seed(0)
    eager = GPT(config)
    with torch.device("meta"):
        meta = GPT(config)
    on_meta = [m for m in meta.modules() if any(p.is_meta for p in m.parameters(recurse=False))]
    torch.manual_seed(0)
    for module in on_meta:  # as engine/parameters/materialize.py does it
        kept = {}
        for p in module.parameters(recurse=False):
            if p.is_meta:  # swapped in place, so the tied head keeps sharing it
                torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="cpu")))
            else:  # the tied weight, real since the embedding's turn
                kept[p] = p.detach().clone()
        with torch.no_grad():
            module.reset_parameters()  # the head's still draws, as an eager build's does
            for p, value in kept.items():
                p.copy_(value)
    assert meta.lm_head in on_meta and meta.lm_head.weight is meta.wte.weight
    expected = eager.state_dict()
    assert all(torch.equal(t, expected[name]) for name, t in meta.state_dict().items())

    weights = dict(eager.named_parameters())
    for name, p in weights.items():
        if name.endswith("bias"):
            assert not p.any(), name
        elif ".ln_" in name or name.startswith("ln_"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = config.residual_std if name.endswith("proj.weight") else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.1), name


def test_activation_checkpointing_keeps_fewer_tensors_for_backward(monkeypatch):
    """Bytes autograd keeps from forward for backward (outside the checkpointed blocks: each block's
    input; inside: nothing until backward recomputes it), and the gradients, with and without."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from train_gpt import GPTLightningModule

    def forward_backward(checkpointing: bool) -> tuple[int, dict]:
        torch.manual_seed(0)
        module = GPTLightningModule(**SHAPE, activation_checkpointing=checkpointing)
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        idx = torch.randint(0, 256, (8, SHAPE["block_size"]), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = module.model(idx, idx)
        loss.backward()
        return sum(saved.values()), {name: p.grad for name, p in module.model.named_parameters()}

    plain_bytes, plain_grads = forward_backward(False)
    checkpointed_bytes, checkpointed_grads = forward_backward(True)
    assert checkpointed_bytes < 0.4 * plain_bytes, (checkpointed_bytes, plain_bytes)
    assert checkpointed_grads.keys() == plain_grads.keys()  # the same parameter names, and checkpoint keys
    assert all(torch.equal(checkpointed_grads[name], g) for name, g in plain_grads.items())


def test_the_four_configs_stack_in_the_cli(results):
    """All four configs at once (`--config` repeated) through the example's CLI, with a tiny model."""
    run_dir = Path(results["stacked_in_the_cli"][0])
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["meta_init"] and hparams["activation_checkpointing"] and hparams["compile"]
    with open(run_dir / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("memory/rank1/total_MB")]
    assert rows and float(rows[-1]["memory/rank1/device/parameters_MB"]) == 0.0  # offloaded
    assert float(rows[-1]["memory/rank1/host/parameters_MB"]) > 0.0

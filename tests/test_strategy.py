"""ZeroStrategy through a real ``Trainer(accelerator="cpu", devices=2)``: parity with Lightning's
DDP at every step (optimizers, stages, bucket sizes, unused parameters) and memory and
communication per rank. Checkpoints and the training-loop features are in ``test_strategy_loop.py``.
All cases run inside one spawned pair of ranks."""

from __future__ import annotations

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback
from lightning_helpers import fit_and_record

STEPS = 4


class _ManySmallParams(torch.nn.Module):
    """60 tiny parameters: per-parameter collectives would be 60 per direction."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(7 if i == 0 else 5, 5) for i in range(30))
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _with_unused_branch():
    from models import OddShapes

    return OddShapes(with_unused_branch=True)


class _StepProbe(Callback):
    """What each rank holds right before each optimizer step, and collectives per step."""

    def __init__(self) -> None:
        self.full_grads_before_step: list[list[str]] = []
        self.reports = []
        self.calls_per_step: list[dict] = []

    def on_train_batch_start(self, *args) -> None:
        from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

        COLLECTIVE_STATS.reset()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning_zero.engine.gradients.sharded_grad import ShardedGradient  # a view of the shards: holds nothing

        self.full_grads_before_step.append(
            [n for n, p in pl_module.named_parameters() if p.grad is not None and not isinstance(p.grad, ShardedGradient)]
        )

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

        self.calls_per_step.append(dict(COLLECTIVE_STATS.calls))
        self.reports.append(trainer.strategy.memory_report())
        self.buckets = len(trainer.strategy.engine.buckets)


GROUP = CaseGroup(world_size=2)
OPTIMIZERS = ("adamw", "sgd_momentum")
STAGES = (1, 2)
BUCKET_SIZES_MB = (1e-4, 25.0)
PARITY_CASES: list[str] = []  # every case that returns per-step differences from DDP


def _ddp_history(ctx: RankContext, key: str, strategy, module_kwargs: dict) -> list:
    """DDP's weights after every step, fitted once per ``key``."""
    return ctx.once(key, lambda: fit_and_record(strategy, STEPS, module_kwargs=module_kwargs)[1])


def parity(ctx: RankContext, optimizer: str, stage: int, bucket_size_mb: float) -> list[float]:
    """max |zero - ddp| after every step, for one optimizer, stage and bucket size."""
    from lightning_helpers import max_abs_diff

    import lightning_zero

    ddp_history = _ddp_history(ctx, f"ddp_{optimizer}", "ddp", {"optimizer": optimizer})
    strategy = lightning_zero.ZeroStrategy(stage=stage, bucket_size_mb=bucket_size_mb)
    _, history, _ = fit_and_record(strategy, STEPS, module_kwargs={"optimizer": optimizer})
    return [max_abs_diff(a, b) for a, b in zip(ddp_history, history)]


# -- parity with DDP at every step, both stages, two optimizers, tiny and large buckets
for _optimizer in OPTIMIZERS:
    for _stage in STAGES:
        for _bucket_size_mb in BUCKET_SIZES_MB:
            _name = f"parity_{_optimizer}_stage{_stage}_bucket{_bucket_size_mb}"
            GROUP.case(parity, name=_name, optimizer=_optimizer, stage=_stage, bucket_size_mb=_bucket_size_mb)
            PARITY_CASES.append(_name)


def unused_branch(ctx: RankContext, strategy: str) -> list[float]:
    """max |zero - ddp| after every step with a branch that gets no gradient: DDP needs
    find_unused_parameters=True, we need nothing."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_helpers import max_abs_diff

    ddp_history = _ddp_history(ctx, "ddp_unused", DDPStrategy(find_unused_parameters=True), {"make_model": _with_unused_branch})
    _, history, _ = fit_and_record(strategy, STEPS, module_kwargs={"make_model": _with_unused_branch})
    return [max_abs_diff(a, b) for a, b in zip(ddp_history, history)]


for _strategy in ("zero1", "zero2"):
    GROUP.case(unused_branch, name=f"unused_{_strategy}", strategy=_strategy)
    PARITY_CASES.append(f"unused_{_strategy}")


def memory_and_communication(ctx: RankContext, strategy: str) -> dict:
    """Gradients held before each step, collectives per step, optimizer state and the memory
    report on this rank, for a model of many small parameters."""
    probe = _StepProbe()
    module, _, trainer = fit_and_record(strategy, STEPS, callbacks=[probe], module_kwargs={"make_model": _ManySmallParams})
    opt = trainer.optimizers[0]
    return {
        "full_grads_before_step": probe.full_grads_before_step,
        "calls_per_step": probe.calls_per_step,
        "buckets": probe.buckets,
        "n_params": len(list(module.parameters())),
        "state_elems": sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step"),
        "model_elems": sum(p.numel() for p in module.parameters()),
        "report": probe.reports[-1],
    }


# -- memory and communication per rank
for _strategy in ("zero1", "zero2"):
    GROUP.case(memory_and_communication, name=f"probe_{_strategy}", strategy=_strategy)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("strategy"))


def test_every_step_bitwise_equal_to_ddp(results):
    for case in PARITY_CASES:
        for diffs in results[case]:
            assert len(diffs) == STEPS, case
            assert diffs == [0.0] * STEPS, f"{case}: max |zero - ddp| per step = {diffs}"


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_only_gradient_shards_remain_after_backward(results, name):
    probe = results[f"probe_{name}"][0]
    assert probe["full_grads_before_step"] == [[]] * STEPS


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_optimizer_state_is_one_nth_per_rank(results, name):
    per_rank = [r["state_elems"] for r in results[f"probe_{name}"]]
    model_elems = results[f"probe_{name}"][0]["model_elems"]
    n_params = results[f"probe_{name}"][0]["n_params"]
    assert sum(per_rank) == 2 * model_elems  # AdamW: exp_avg + exp_avg_sq, each element on one rank
    for elems in per_rank:
        assert abs(elems - model_elems) <= 2 * n_params  # 1/N of 2 slots, up to one padding element per param


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_collectives_per_step_bounded_by_buckets_not_parameters(results, name):
    probe = results[f"probe_{name}"][0]
    assert probe["n_params"] == 62 and probe["buckets"] == 1
    for calls in probe["calls_per_step"]:
        assert calls == {"reduce_scatter": 1, "all_gather": 1}


def test_memory_report_counts_shards(results):
    for name in ("zero1", "zero2"):
        report = results[f"probe_{name}"][0]["report"]
        model_bytes = 4 * results[f"probe_{name}"][0]["model_elems"]
        n_params = results[f"probe_{name}"][0]["n_params"]
        assert report.parameters == model_bytes  # stages 1-2 keep full parameters
        # AdamW: 2 fp32 slots over 2 ranks = model_bytes, + a padding element per slot and a
        # 4-byte step count per parameter
        assert model_bytes * 0.9 <= report.optimizer_state <= model_bytes + 12 * n_params
        # after the step, only gradient shards are held: about half the model
        assert report.gradients <= model_bytes / 2 + 4 * n_params

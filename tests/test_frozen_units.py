"""Stage 3's ``keep_frozen_units_mb``: all-frozen units gathered once per optimizer step under
gradient accumulation, bitwise the weights of regathering them, with the all-gathers saved counted
from the model's sizes (see [Note: kept frozen units] in ``engine/parameters/kept_units.py``)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import full_weights, make_trainer, regression_data
from lora_models import IN_FEATURES, OUT_FEATURES, LoraStack, full_bytes, gather_bytes

MICRO_BATCHES = 4
STEPS = 2
GROUP = CaseGroup(world_size=2)


def _ensure_group() -> None:
    """Engine cases on the default gloo group (a Trainer case before them made it already)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, IN_FEATURES, generator=g), torch.randn(4, OUT_FEATURES, generator=g)


def _accumulate(keep_mb: float, evaluate_after: Optional[int] = None) -> dict[str, Any]:
    """``STEPS`` optimizer steps of ``MICRO_BATCHES`` micro-batches each on a plain engine loop (as the
    strategies drive it: ``end_step`` after every backward, ``sync_gradients`` on the last one);
    ``evaluate_after``: an evaluation step after that micro-batch of every step (validation in the
    middle of accumulation)."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    _ensure_group()
    torch.manual_seed(0)
    model = LoraStack()
    sizes = _sizes(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, keep_frozen_units_mb=keep_mb))
    rank = torch.distributed.get_rank()
    gathers, kept_mid, kept_after, frozen_mid, frozen_after = [], [], [], [], []
    for step in range(STEPS):
        COLLECTIVE_STATS.reset()
        for micro in range(MICRO_BATCHES):
            engine.sync_gradients = micro == MICRO_BATCHES - 1
            x, y = _batch(rank, step, micro)
            engine.begin_step()
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.before_backward()
            loss.backward()
            engine.finish_backward()
            engine.end_step()
            if micro == 0:
                report = engine.memory_report()
                kept_mid.append(report.kept_frozen_units)
                frozen_mid.append(report.frozen_device)
            if micro == evaluate_after:
                with torch.no_grad():
                    engine.begin_evaluation_step()
                    kept_mid.append(engine.memory_report().kept_frozen_units)  # freed for evaluation
                    model(x)
                    engine.end_step()
                engine.finish_evaluation()
        gathers.append((COLLECTIVE_STATS.calls["all_gather"], COLLECTIVE_STATS.bytes["all_gather"]))
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        report = engine.memory_report()
        kept_after.append(report.kept_frozen_units)
        frozen_after.append(report.frozen_device)
    weights = engine.full_state_dict(model)
    engine.close()
    return dict(gathers=gathers, kept_mid=kept_mid, kept_after=kept_after, frozen_mid=frozen_mid, frozen_after=frozen_after, weights=weights, sizes=sizes)


def _sizes(model: LoraStack, n: int = GROUP.world_size) -> dict[str, Any]:
    """What the gathers and reports follow from, read off the model before it is sharded."""
    root_frozen = list(model.inp.parameters())
    root_trained = list(model.head.parameters())
    units = list(model.layers)
    frozen_units = model.frozen_blocks()
    return dict(
        root_gather=gather_bytes(root_frozen, n) + gather_bytes(root_trained, n),
        unit_gathers=[gather_bytes(list(u.parameters()), n) for u in units],
        frozen_gathers=[gather_bytes(list(u.parameters()), n) for u in frozen_units],
        frozen_full=[full_bytes(u) for u in frozen_units],
        frozen_chunks=sum(-(-p.numel() // n) * p.element_size() for p in model.parameters() if not p.requires_grad),
        units=len(units),
    )


class _LoraModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LoraStack()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class _StepGathers(Callback):
    """All-gathers per optimizer step, and the kept bytes after a step's first micro-batch and at
    the optimizer step."""

    def __init__(self) -> None:
        self.per_step: list[tuple[int, int]] = []
        self.kept_mid: list[int] = []
        self.kept_at_step: list[int] = []
        self._start = (0, 0)

    @staticmethod
    def _now() -> tuple[int, int]:
        from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

        return COLLECTIVE_STATS.calls["all_gather"], COLLECTIVE_STATS.bytes["all_gather"]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % MICRO_BATCHES == 0:
            self._start = self._now()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % MICRO_BATCHES == 0:
            self.kept_mid.append(trainer.strategy.memory_report().kept_frozen_units)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        now = self._now()
        self.per_step.append((now[0] - self._start[0], now[1] - self._start[1]))
        self.kept_at_step.append(trainer.strategy.memory_report().kept_frozen_units)


def _trainer_run(ctx: RankContext, keep_mb: float) -> dict:
    """Fit with ``accumulate_grad_batches``, then save a checkpoint and validate, as a user would."""
    from lightning_zero import ZeroStrategy

    L.seed_everything(0, verbose=False)
    module = _LoraModule()
    sizes = _sizes(module.model)
    counter = _StepGathers()
    strategy = ZeroStrategy(stage=3, keep_frozen_units_mb=keep_mb, timeout=timedelta(seconds=60))
    trainer = make_trainer(strategy, max_steps=STEPS, callbacks=[counter], accumulate_grad_batches=MICRO_BATCHES, num_sanity_val_steps=0, limit_val_batches=2)
    data = regression_data(n=2 * 4 * MICRO_BATCHES * STEPS, batch_size=4)
    trainer.fit(module, data, data)
    reports = {"fit": strategy.memory_report()}
    trainer.save_checkpoint(f"{ctx.tmpdir}/frozen_{keep_mb}")
    reports["save"] = strategy.memory_report()
    trainer.validate(module, data, verbose=False)
    reports["validate"] = strategy.memory_report()
    return dict(
        sizes=sizes, per_step=counter.per_step, kept_mid=counter.kept_mid, kept_at_step=counter.kept_at_step,
        reports=reports, weights=full_weights(module, strategy),
    )  # fmt: skip


GROUP.case(_trainer_run, name="trainer_default", keep_mb=0)
GROUP.case(_trainer_run, name="trainer_keep_all", keep_mb=math.inf)


def _fabric_run(ctx: RankContext, keep_mb: float) -> dict:
    """The Fabric loop of a user accumulating gradients with ``no_backward_sync``."""
    from fabric_loop import fabric_for
    from fabric_loop import full_weights as fabric_weights

    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    fabric = fabric_for("zero3", keep_frozen_units_mb=keep_mb)
    torch.manual_seed(0)
    model = LoraStack()
    sizes = _sizes(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    per_step = []
    for step in range(STEPS):
        COLLECTIVE_STATS.reset()
        for micro in range(MICRO_BATCHES):
            x, y = _batch(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < MICRO_BATCHES - 1):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        per_step.append((COLLECTIVE_STATS.calls["all_gather"], COLLECTIVE_STATS.bytes["all_gather"]))
        optimizer.step()
        optimizer.zero_grad()
    return dict(sizes=sizes, per_step=per_step, weights=fabric_weights(fabric, model))


GROUP.case(_fabric_run, name="fabric_default", keep_mb=0)
GROUP.case(_fabric_run, name="fabric_keep_all", keep_mb=math.inf)


@GROUP.case
def engine_default(ctx: RankContext) -> dict:
    return _accumulate(0)


@GROUP.case
def engine_keep_all(ctx: RankContext) -> dict:
    return _accumulate(math.inf)


@GROUP.case
def engine_keep_two(ctx: RankContext) -> dict:
    # room for two frozen blocks' full weights and a byte more: the third (last used) is regathered
    frozen_full = _sizes(LoraStack())["frozen_full"]
    return _accumulate((frozen_full[0] + frozen_full[1] + 1) / 2**20)


@GROUP.case
def engine_validation_mid_accumulation(ctx: RankContext) -> dict:
    return dict(default=_accumulate(0, evaluate_after=1), kept=_accumulate(math.inf, evaluate_after=1))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("frozen_units"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_kept_units_train_bitwise_as_regathered(results: GroupResults) -> None:
    for default, kept, two in zip(results["engine_default"], results["engine_keep_all"], results["engine_keep_two"]):
        _assert_same_weights(default["weights"], kept["weights"])
        _assert_same_weights(default["weights"], two["weights"])
        assert any(not torch.equal(w, torch.zeros_like(w)) for w in kept["weights"].values())


def test_all_gathers_per_step_drop_as_the_sizes_say(results: GroupResults) -> None:
    for default, kept, two in zip(results["engine_default"], results["engine_keep_all"], results["engine_keep_two"]):
        sizes, k = default["sizes"], MICRO_BATCHES
        # without: the root unit (2 buckets: frozen and trained) per micro-batch, every other unit
        # in each micro-batch's forward and backward
        expected_bytes = k * sizes["root_gather"] + 2 * k * sum(sizes["unit_gathers"])
        expected_calls = k * 2 + 2 * k * sizes["units"]
        assert default["gathers"] == [(expected_calls, expected_bytes)] * STEPS
        # kept: each frozen block once per optimizer step instead of 2K times
        frozen = sizes["frozen_gathers"]
        saved = (2 * k - 1) * sum(frozen)
        assert kept["gathers"] == [(expected_calls - (2 * k - 1) * len(frozen), expected_bytes - saved)] * STEPS
        saved_two = (2 * k - 1) * (frozen[0] + frozen[1])
        assert two["gathers"] == [(expected_calls - (2 * k - 1) * 2, expected_bytes - saved_two)] * STEPS


def test_memory_report_shows_the_kept_bytes_until_the_step(results: GroupResults) -> None:
    for default, kept, two in zip(results["engine_default"], results["engine_keep_all"], results["engine_keep_two"]):
        full, chunks = default["sizes"]["frozen_full"], default["sizes"]["frozen_chunks"]
        assert default["kept_mid"] == [0] * STEPS
        assert kept["kept_mid"] == [sum(full)] * STEPS
        assert two["kept_mid"] == [full[0] + full[1]] * STEPS
        for run in (default, kept, two):
            assert run["kept_after"] == [0] * STEPS  # freed at the optimizer step
            assert run["frozen_after"] == [chunks] * STEPS  # this rank's chunks of the frozen weights
            # part of the frozen weights' bytes while kept
            assert [f - c for f, c in zip(run["frozen_mid"], [chunks] * STEPS)] == run["kept_mid"]


def test_evaluation_in_the_middle_of_accumulation(results: GroupResults) -> None:
    for r in results["engine_validation_mid_accumulation"]:
        _assert_same_weights(r["default"]["weights"], r["kept"]["weights"])
        full = r["kept"]["sizes"]["frozen_full"]
        # per step: kept after micro-batch 0, freed when the evaluation step begins
        assert r["kept"]["kept_mid"] == [sum(full), 0] * STEPS
        assert r["kept"]["kept_after"] == [0] * STEPS


def _expected_gathers(sizes: dict[str, Any], kept_units: list[int]) -> tuple[int, int]:
    """All-gathers (calls, bytes) per optimizer step of ``MICRO_BATCHES`` micro-batches: the root unit
    (2 buckets: frozen and trained) once per micro-batch, every other unit in each micro-batch's
    forward and backward, but a kept frozen block (``kept_units``: indices among the frozen blocks)
    once per step."""
    k, frozen = MICRO_BATCHES, sizes["frozen_gathers"]
    calls = k * 2 + 2 * k * sizes["units"] - (2 * k - 1) * len(kept_units)
    nbytes = k * sizes["root_gather"] + 2 * k * sum(sizes["unit_gathers"]) - (2 * k - 1) * sum(frozen[i] for i in kept_units)
    return calls, nbytes


def test_trainer_accumulation_keeps_frozen_units(results: GroupResults) -> None:
    for default, kept in zip(results["trainer_default"], results["trainer_keep_all"]):
        _assert_same_weights(default["weights"], kept["weights"])
        sizes = default["sizes"]
        assert default["per_step"] == [_expected_gathers(sizes, [])] * STEPS
        assert kept["per_step"] == [_expected_gathers(sizes, [0, 1, 2])] * STEPS
        assert default["kept_mid"] == [0] * STEPS and kept["kept_mid"] == [sum(sizes["frozen_full"])] * STEPS
        assert kept["kept_at_step"] == [0] * STEPS  # freed right before the optimizer step
        for phase, report in kept["reports"].items():  # after fit, a save, validation after fit
            assert report.kept_frozen_units == 0, phase
            assert report.frozen_parameters == sizes["frozen_chunks"], phase


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(stage=2, keep_frozen_units_mb=64), ValueError, "only applies at stage 3"),
        (dict(stage=1, keep_frozen_units_mb=math.inf), ValueError, "only applies at stage 3"),
        (dict(stage=3, keep_frozen_units_mb=-1), ValueError, "0 or more MiB"),
        (dict(stage=3, keep_frozen_units_mb=float("nan")), ValueError, "0 or more MiB"),
        (dict(stage=3, keep_frozen_units_mb="64"), TypeError, "number of MiB"),
        (dict(stage=3, keep_frozen_units_mb=True), TypeError, "number of MiB"),
    ],
)
def test_bad_budgets_fail_at_construction(options: dict, error: type, match: str) -> None:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy
    from lightning_zero.engine import ZeroConfig

    for make in (ZeroConfig, ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(error, match=match):
            make(**options)


def test_strategies_pass_the_budget_through() -> None:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    for make in (ZeroStrategy, ZeroFabricStrategy):
        assert make(stage=3, keep_frozen_units_mb=math.inf).zero_config.kept_frozen_bytes == math.inf
        assert make(stage=3, keep_frozen_units_mb=1.5).zero_config.kept_frozen_bytes == 1.5 * 2**20
        assert make(stage=3).zero_config.keep_frozen_units_mb == 0  # default: regather per use


def test_fabric_accumulation_keeps_frozen_units(results: GroupResults) -> None:
    for default, kept in zip(results["fabric_default"], results["fabric_keep_all"]):
        _assert_same_weights(default["weights"], kept["weights"])
        assert default["per_step"] == [_expected_gathers(default["sizes"], [])] * STEPS
        assert kept["per_step"] == [_expected_gathers(default["sizes"], [0, 1, 2])] * STEPS

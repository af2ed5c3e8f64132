"""What goes wrong on some ranks only, or behind the engine's back, fails loudly or works — never a
hang or silently wrong weights: a backward that skips units on one rank (at stages 2-3, also with
skips drawn at random per rank and step), ranks running different numbers of evaluation batches, a
parameter object replaced during training, ``.data`` assigned to parameters at rest, and a weight
exported with ``.numpy()`` inside ``summon_full_params``. Every group runs under a timeout (and
every process group with a short collective timeout), so a regression fails instead of hanging CI."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback
from multiprocess import run_on_ranks
from skipping_runs import COLLECTIVE_TIMEOUT, RANDOM_BLOCKS, STEPS, Schedule, block_6_from_step_2, engine_or_ddp_run, random_skips


def _strategy(name: str, **options: Any):
    """A strategy by label, with the short collective timeout."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    if name == "ddp_find_unused":
        return DDPStrategy(find_unused_parameters=True, timeout=COLLECTIVE_TIMEOUT)
    if name == "ddp":
        return DDPStrategy(timeout=COLLECTIVE_TIMEOUT)
    return ZeroStrategy(stage=int(name[-1]), timeout=COLLECTIVE_TIMEOUT, **options)


# ---- (1) a backward that skips units on one rank ---------------------------------------------------
def _detached_training_step(self, batch, batch_idx, detaching_rank: int = 1):
    """The GPT's forward, but ``detaching_rank`` detaches the residual stream after block 1: its
    backward never reaches blocks 0 and 1 (nor the position embedding), the other rank's does."""
    import torch.distributed as dist

    model, idx, targets = self.model, batch[0][:, :-1], batch[0][:, 1:]
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    for i, block in enumerate(model.blocks):
        x = block(x)
        if i == 1 and dist.get_rank() == detaching_rank:
            x = x.detach()
    logits = model.lm_head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def backward_divergence(ctx: RankContext, strategy: str, detaching_rank: int, **options: Any) -> list:
    """The weights after each step of a fit whose backward differs between the ranks."""
    import functools

    import lightning as L
    from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    module = GPTModule()
    module.training_step = functools.partial(_detached_training_step, module, detaching_rank=detaching_rank)
    recorder = WeightRecorder()
    make_trainer(_strategy(strategy, **options), STEPS, callbacks=[recorder]).fit(module, token_data())
    return recorder.history


GROUP = CaseGroup(world_size=2, timeout=180)  # the cases take ~20 s; a hang fails the file
BACKWARD_DIVERGENCE = {
    # label: (strategy, rank that detaches, strategy options)
    "ddp_rank1": ("ddp_find_unused", 1, {}),
    "zero3_rank1": ("zero3", 1, {}),
    "zero3_rank1_no_prefetch": ("zero3", 1, {"prefetch_units": 0}),
    "zero3_rank1_tags_per_backward": ("zero3", 1, {"check_units_every_gather": False}),
    "zero2_rank1": ("zero2", 1, {}),
    "ddp_rank0": ("ddp_find_unused", 0, {}),
    "zero3_rank0": ("zero3", 0, {"prefetch_units": 2}),
}
for _label, (_strategy_name, _rank, _options) in BACKWARD_DIVERGENCE.items():
    GROUP.case(backward_divergence, name=f"backward_{_label}", strategy=_strategy_name, detaching_rank=_rank, **_options)


# ---- units skipped on some ranks, against torch DDP (engine level, no Trainer) ----------------------
SKIPPING_RUNS = {
    # run: (schedule, blocks, GPT or not, {label: (strategy, engine options)})
    "middle_skip": (block_6_from_step_2, 8, True, {
        "ddp": ("ddp", {}),
        "zero2": ("zero2", {}),
        "zero3": ("zero3", {}),
        "zero3_no_prefetch": ("zero3", {"prefetch_units": 0}),
        "zero3_prefetch_2": ("zero3", {"prefetch_units": 2}),
    }),
    "random_skips": (random_skips, RANDOM_BLOCKS, False, {  # each block one unit
        "ddp": ("ddp", {}),
        "zero2": ("zero2", {}),
        "zero3": ("zero3", {"unit_classes": ["Sequential"]}),
    }),
}  # fmt: skip
for _run, (_schedule, _blocks, _gpt, _runs) in SKIPPING_RUNS.items():
    for _label, (_strategy_name, _options) in _runs.items():
        GROUP.case(
            engine_or_ddp_run, name=f"{_run}_{_label}", strategy=_strategy_name, schedule=_schedule, blocks=_blocks, gpt=_gpt, **_options
        )


# ---- `param.data = value` between steps (pretrained weights loaded into a built model) -------------
def _no_skips(rank: int) -> Schedule:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, 32, (2, 9), generator=g), frozenset()) for _ in range(STEPS + 1)]


for _strategy_name in ("ddp", "zero2", "zero3"):
    GROUP.case(
        engine_or_ddp_run, name=f"pretrained_{_strategy_name}", strategy=_strategy_name, schedule=_no_skips, blocks=2, gpt=True, pretrained_before=2
    )


# ---- (2) ranks that run different numbers of evaluation batches ------------------------------------
def _uneven_loader(rank: int, batches: tuple[int, int] = (5, 2)):
    """Rank 0 gets 5 batches, rank 1 gets 2: a loader made per rank, without DistributedSampler."""
    from lightning_helpers import token_data

    return token_data(n=2 * batches[rank])


def _local_validation_step(self, batch, batch_idx):
    """No ``sync_dist``: under DDP, too, uneven batches only work while a step communicates nothing."""
    loss = self(batch[0][:, :-1], batch[0][:, 1:])[1]
    self.log("val_loss", loss)
    return loss


@GROUP.case
def uneven_evaluation(ctx: RankContext) -> dict:
    """Validation inside fit (with ModelCheckpoint's collectives after it), validate, test-free
    predict: DDP and zero3 with the same per-rank loaders."""
    import os

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data

    out: dict[str, Any] = {}
    for name in ("ddp", "zero3"):
        L.seed_everything(0, verbose=False)
        module = GPTModule()
        module.validation_step = _local_validation_step.__get__(module)
        recorder = WeightRecorder()
        checkpoint = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, f"uneven_{name}"), monitor="val_loss", save_top_k=1)
        trainer = make_trainer(
            _strategy(name), 4, callbacks=[recorder, checkpoint], use_distributed_sampler=False,
            val_check_interval=2, enable_checkpointing=True, num_sanity_val_steps=2,
        )  # fmt: skip
        trainer.fit(module, token_data(), _uneven_loader(ctx.rank))
        validated = trainer.validate(module, _uneven_loader(ctx.rank), verbose=False)[0]["val_loss"]
        predicted = trainer.predict(module, _uneven_loader(ctx.rank, batches=(1, 4)))
        out[name] = {
            "history": recorder.history,
            "fit_val_loss": trainer.callback_metrics.get("val_loss"),
            "validate": validated,
            "predict": torch.cat(predicted),
            "best": os.path.basename(checkpoint.best_model_path),
        }
    return out


# ---- (3) a parameter object replaced after setup ----------------------------------------------------
class _ReplaceParameterObject(Callback):
    def __init__(self, ranks: tuple[int, ...] = (0, 1)) -> None:
        self.ranks = ranks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1 and trainer.global_rank in self.ranks:
            pl_module.model.ln_f.weight = torch.nn.Parameter(torch.ones(16))


def replaced_object(ctx: RankContext, strategy: str) -> Optional[str]:
    """What a fit raises when every rank replaces ``ln_f.weight`` at batch 1 (None: nothing)."""
    import lightning as L
    from lightning_helpers import GPTModule, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(_strategy(strategy), STEPS, callbacks=[_ReplaceParameterObject()])
    try:
        trainer.fit(GPTModule(), token_data())
    except RuntimeError as err:
        return str(err)
    return None


for _stage in (1, 2, 3):
    GROUP.case(replaced_object, name=f"replaced_object_zero{_stage}", strategy=f"zero{_stage}")


# ---- (6) `.numpy()` inside summon_full_params ---------------------------------------------------------
class _ExportWithNumpy(Callback):
    """At batch 1, exports every weight with ``.numpy()`` inside the summon context, keeping the
    arrays (they share the gathered memory) to the end of the fit."""

    def __init__(self) -> None:
        self.arrays: dict[str, Any] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            import contextlib

            summon = getattr(trainer.strategy, "summon_full_params", contextlib.nullcontext)  # DDP: no-op
            with summon():
                self.arrays = {name: p.detach().numpy() for name, p in pl_module.named_parameters()}
                self.at_export = {name: a.copy() for name, a in self.arrays.items()}


@GROUP.case
def numpy_in_summon(ctx: RankContext) -> dict:
    from lightning_helpers import fit_gpt

    out = {}
    for name in ("ddp", "zero3"):
        export = _ExportWithNumpy()
        _, history, _ = fit_gpt(_strategy(name), STEPS + 1, callbacks=[export])
        out[name] = {
            "history": history,
            "at_export": {k: torch.from_numpy(a) for k, a in export.at_export.items()},
            "kept": {k: torch.from_numpy(a.copy()) for k, a in export.arrays.items()},  # at the end
        }
    return out


# ---- the strategy's `timeout` bounds stage 3's own all-gathers too ------------------------------------
STALL_S = 20
"""How long rank 1 stays away at most: far beyond the strategy's 5 s timeout."""


class _StallRank1(Callback):
    """Rank 1 stays away from its second step until rank 0 has failed (the file ``failed`` appears)
    or ``STALL_S`` passed, while rank 0 waits in that step's first all-gather."""

    def __init__(self, failed: Path) -> None:
        self.failed = failed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1 and trainer.global_rank == 1:
            import time

            deadline = time.monotonic() + STALL_S
            while not self.failed.exists() and time.monotonic() < deadline:
                time.sleep(0.05)


@GROUP.case
def stalled_peer(ctx: RankContext) -> dict:
    """Last in the group: it leaves the process groups broken. Returns what each rank raised and
    how long it took."""
    import time

    import lightning as L
    from lightning_helpers import GPTModule, make_trainer, token_data

    from lightning_zero import ZeroStrategy

    L.seed_everything(0, verbose=False)
    strategy = ZeroStrategy(stage=3, timeout=timedelta(seconds=5))
    failed = Path(ctx.tmpdir) / "stalled_peer_failed"
    start = time.monotonic()
    try:
        make_trainer(strategy, STEPS, callbacks=[_StallRank1(failed)]).fit(GPTModule(), token_data())
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        seconds = time.monotonic() - start
        failed.touch()
        return {"error": f"{type(err).__name__}: {err}", "seconds": seconds}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("reliability"))


# ---- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", [k for k in BACKWARD_DIVERGENCE if not k.startswith("ddp")])
def test_a_backward_that_skips_units_on_one_rank_trains_like_ddp(results, label):
    from lightning_helpers import max_abs_diff

    reference = results[f"backward_ddp_rank{BACKWARD_DIVERGENCE[label][1]}"]
    for ddp_history, history in zip(reference, results[f"backward_{label}"]):
        assert len(history) == STEPS
        assert [max_abs_diff(a, b) for a, b in zip(ddp_history, history)] == [0.0] * STEPS


def _assert_skipping_run_like_ddp(results: GroupResults, run: str, label: str) -> None:
    from lightning_helpers import max_abs_diff

    from lightning_zero.engine.parameters.residency import IN_FLIGHT

    for ddp, zero in zip(results[f"{run}_ddp"], results[f"{run}_{label}"]):
        assert zero["buckets"] > IN_FLIGHT + 1  # more buckets become ready than may be in flight
        assert torch.equal(zero["losses"], ddp["losses"])  # every step, bitwise
        assert max_abs_diff(zero["weights"], ddp["weights"]) == 0.0


@pytest.mark.parametrize("label", [k for k in SKIPPING_RUNS["middle_skip"][3] if k != "ddp"])
def test_a_middle_block_skipped_on_one_rank_trains_like_ddp(results, label):
    """The issue's 8-block reproduction: a hang until the collective timeout, when the rank whose
    backward reached block 6 waited in it for the reduce-scatter the other rank issues only after."""
    _assert_skipping_run_like_ddp(results, "middle_skip", label)


@pytest.mark.parametrize("label", [k for k in SKIPPING_RUNS["random_skips"][3] if k != "ddp"])
def test_units_skipped_at_random_on_each_rank_train_like_ddp(results, label):
    _assert_skipping_run_like_ddp(results, "random_skips", label)


@pytest.mark.parametrize("stage", [2, 3])
def test_data_assigned_between_steps_is_adopted_as_under_ddp(results, stage):
    """Every parameter's ``.data`` assigned pretrained weights before step 2 (at stage 3 while at
    rest): the same losses and weights as DDP with the same assignment, in the steps after."""
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["pretrained_ddp"], results[f"pretrained_zero{stage}"]):
        assert torch.equal(zero["losses"], ddp["losses"])
        assert max_abs_diff(zero["weights"], ddp["weights"]) == 0.0


def test_ranks_running_different_numbers_of_evaluation_batches_finish_as_under_ddp(results):
    from lightning_helpers import max_abs_diff

    for rank, r in enumerate(results["uneven_evaluation"]):
        ddp, zero3 = r["ddp"], r["zero3"]
        assert [max_abs_diff(a, b) for a, b in zip(ddp["history"], zero3["history"])] == [0.0] * 4
        assert zero3["fit_val_loss"] == ddp["fit_val_loss"]
        assert zero3["validate"] == ddp["validate"]
        assert torch.equal(zero3["predict"], ddp["predict"])
        assert zero3["predict"].shape[0] == 2 * (1, 4)[rank]  # each rank predicted all of its batches
        assert zero3["best"] == ddp["best"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_replaced_parameter_object_fails_on_every_rank_naming_it(results, stage):
    for message in results[f"replaced_object_zero{stage}"]:
        assert message is not None and "'model.ln_f.weight' was replaced by a new object" in message
        assert "summon_full_params(writeback=True)" in message


def test_numpy_inside_summon_exports_the_weights_and_training_goes_on(results):
    from lightning_helpers import max_abs_diff

    for r in results["numpy_in_summon"]:
        assert max_abs_diff(r["ddp"]["at_export"], r["zero3"]["at_export"]) == 0.0
        assert r["zero3"]["at_export"]["model.wte.weight"].shape == (256, 16)
        # the arrays keep the values they were exported with: later gathers went to new memory
        assert max_abs_diff(r["zero3"]["kept"], r["zero3"]["at_export"]) == 0.0
        assert [max_abs_diff(a, b) for a, b in zip(r["ddp"]["history"], r["zero3"]["history"])] == [0.0] * (STEPS + 1)


# ---- one rank replaces a parameter: it names it, and its peer does not hang ---------------------------
def _replace_on_rank_1(rank: int, world_size: int) -> str:
    """Like a process Lightning launched: the failing rank reports and exits; its peer must fail
    too (a lost peer), not wait for it."""
    import os

    import lightning as L
    from lightning_helpers import GPTModule, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(_strategy("zero3"), STEPS, callbacks=[_ReplaceParameterObject(ranks=(1,))])
    try:
        trainer.fit(GPTModule(), token_data())
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        if rank == 1:
            print(f"rank 1: {err}", flush=True)
            os._exit(17)
        return f"{type(err).__name__}: {err}"
    return "finished"


def test_a_parameter_replaced_on_one_rank_fails_it_and_its_peer_promptly():
    import time

    start = time.monotonic()
    outcomes = run_on_ranks(_replace_on_rank_1, world_size=2, init_process_group=False, timeout=120, tolerate_deaths=True)
    assert outcomes[1] is None  # it exited, as a launched process does
    assert outcomes[0] is not None and outcomes[0] != "finished"
    assert time.monotonic() - start < 100


def test_the_strategy_timeout_bounds_stage_3_all_gathers(results):
    rank0 = results["stalled_peer"][0]
    assert rank0["error"] is not None and "imed out" in rank0["error"]  # gloo: "Timed out waiting ..."
    assert rank0["seconds"] < STALL_S  # the 5 s timeout, not torch's 30 minutes nor rank 1's return

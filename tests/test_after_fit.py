"""After ``fit`` a stage-3 module stays sharded at rest (see [Note: after fit] in
``engine/parameters/module_link.py``): what users do next — validate, predict, save, look at the weights, fit
again — gives DDP's answers, and no phase of the lifecycle brings the full model onto a rank that
did not ask for it.

Memory: each rank's peak RSS per phase (VmHWM, reset between phases; glibc's mmap threshold lowered
so freed buffers leave the process, see ``bench/memory.py``) for a GPT whose full fp32 weights are
8 units. No phase may exceed the fit's peak by more than one unit plus ``MARGIN``; rank 0's full
save may rise by at most 1.1x the checkpoint file's size above what it held before the save.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
from case_groups import CaseGroup, GroupResults, RankContext

GROUP = CaseGroup(world_size=2)
STEPS = 4
MARGIN = 12 * 2**20
"""Allowed above the fit's peak besides one unit: Python objects, Lightning's loop state, glibc's
bookkeeping (measured: validate/test/predict and saves stay under the fit's peak)."""
RESUME_MARGIN = 24 * 2**20
"""The same for the resumed run, which also reads the checkpoint through DCP's buffers in processes
that already ran one fit (measured: a stage-2 resume rose 8-12 MB above the first fit's peak; the
first run's module kept alive, as before `_weakly` in gather_schedule.py, adds ~90 MB)."""
FULL_SAVE_FACTOR = 1.1


# ---- the lifecycle's memory -----------------------------------------------------------------------
SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")


def lifecycle(ctx: RankContext, stage: int) -> dict:
    """``scripts/lifecycle_memory.py``'s phases on a GPT of 8 blocks of 1.8M parameters (7.1 MB
    each, 57 MB in all)."""
    import sys

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.models.gpt import Block, GPTConfig

    sys.path.insert(0, SCRIPTS)
    from lifecycle_memory import measure_lifecycle

    config = GPTConfig(block_size=32, n_layer=8, n_head=6, n_embd=384)
    g = torch.Generator().manual_seed(3)
    data = DataLoader(TensorDataset(torch.randint(0, 256, (16, 33), generator=g)), batch_size=2)
    out = os.path.join(ctx.tmpdir, f"life{stage}")
    result = measure_lifecycle(lambda: ZeroStrategy(stage=stage), config, data, out, accelerator="cpu", devices=ctx.world_size)
    return {**result, "unit_bytes": sum(p.numel() * 4 for p in Block(config).parameters())}


GROUP.case(lifecycle, name="lifecycle_zero3", stage=3)
GROUP.case(lifecycle, name="lifecycle_zero2", stage=2)


@GROUP.case
def dropped_after_fit(ctx: RankContext) -> dict:
    """A module and Trainer the user drops after a stage-3 fit are freed, engine and all."""
    import weakref

    from lightning_helpers import fit_gpt

    from lightning_zero.engine.engine import linked_engine

    module, _, trainer = fit_gpt("zero3", 2)
    alive = [weakref.ref(o) for o in (module, trainer, linked_engine(module))]
    del module, trainer
    gc.collect()
    return {"alive": [ref() is not None for ref in alive]}


# ---- what users do after fit, against DDP ---------------------------------------------------------
@GROUP.case
def after_fit(ctx: RankContext) -> dict:
    import lightning as L
    import torch
    from lightning_helpers import fit_gpt, full_weights, make_trainer, max_abs_diff, token_data

    from lightning_zero.engine.engine import linked_engine
    from lightning_zero.engine.shards.at_rest import is_at_rest

    ref, _, ref_trainer = fit_gpt("ddp", STEPS)
    module, _, trainer = fit_gpt("zero3", STEPS)
    out: dict[str, Any] = {}
    out["at_rest"] = all(is_at_rest(p) for p in module.parameters())
    # a read at rest gathers that one parameter (on every rank); a write reaches the chunks, as
    # DDP's reaches its replica (both edited alike, and back)
    out["read_at_rest"] = (module.model.wte.weight.sum().item(), ref.model.wte.weight.sum().item())
    with torch.no_grad():
        for m in (module, ref):
            m.model.wte.weight.add_(1.0)
    out["write_at_rest"] = (module.model.wte.weight.sum().item(), ref.model.wte.weight.sum().item())
    with torch.no_grad():
        for m in (module, ref):
            m.model.wte.weight.sub_(1.0)
    out["weights"] = max_abs_diff(full_weights(ref), full_weights(module, trainer.strategy))

    def evaluated(t: L.Trainer, m: L.LightningModule) -> tuple[float, torch.Tensor]:
        loss = t.validate(m, token_data(8), verbose=False)[0]["val_loss"]
        return loss, torch.cat(t.predict(m, token_data(8)))

    (ref_loss, ref_pred), (loss, pred) = evaluated(ref_trainer, ref), evaluated(trainer, module)
    out["validate"], out["predict"] = (ref_loss, loss), torch.equal(ref_pred, pred)
    out["at_rest_after_evaluation"] = all(is_at_rest(p) for p in module.parameters())

    # FSDP's knobs: rank 0 alone gets host copies; the others keep their chunks
    strategy = trainer.strategy
    with strategy.summon_full_params(rank0_only=True, offload_to_cpu=True):
        if ctx.rank == 0:
            copies = {k: v.clone() for k, v in module.state_dict().items()}
            out["rank0_copies"] = max_abs_diff(full_weights(ref), copies)
            out["rank0_devices"] = {str(p.device) for p in module.parameters()}
        else:
            out["others_at_rest"] = all(is_at_rest(p) for p in module.parameters())
    try:
        with strategy.summon_full_params(rank0_only=True, writeback=True):
            pass
        out["rank0_writeback"] = None
    except ValueError as err:
        out["rank0_writeback"] = str(err)
    with strategy.summon_full_params(offload_to_cpu=True, writeback=True), torch.no_grad():
        module.model.blocks[1].mlp.fc.weight.mul_(0.5)
    with torch.no_grad():
        ref.model.blocks[1].mlp.fc.weight.mul_(0.5)
    out["written_back"] = max_abs_diff(full_weights(ref), full_weights(module, strategy))

    # a full file after fit, as DDP writes it
    strategy.state_dict_type = "full"
    for t, name in ((ref_trainer, "ddp"), (trainer, "zero3")):
        t.save_checkpoint(os.path.join(ctx.tmpdir, f"after_fit_{name}.ckpt"))
    if ctx.rank == 0:
        saved = {n: torch.load(os.path.join(ctx.tmpdir, f"after_fit_{n}.ckpt"), weights_only=False) for n in ("ddp", "zero3")}
        out["file_weights"] = max_abs_diff(saved["ddp"]["state_dict"], saved["zero3"]["state_dict"])
        states = [saved[n]["optimizer_states"][0]["state"] for n in ("ddp", "zero3")]
        out["file_optimizer"] = max(
            (states[0][i][k] - states[1][i][k]).abs().max().item() for i in states[0] for k in ("exp_avg", "exp_avg_sq")
        )

    # a second fit in the same process goes on from the shards, with the new run's optimizer only
    engine = linked_engine(module)
    second = {}
    for name, m in (("ddp", ref), ("zero3", module)):
        L.seed_everything(1, verbose=False)
        second[name] = make_trainer(name, 2)
        second[name].fit(m, token_data())
    out["same_engine"] = linked_engine(module) is engine and len(engine.optimizers) == 1
    out["second_fit"] = max_abs_diff(full_weights(ref), full_weights(module, second["zero3"].strategy))

    # another configuration takes the module over: it releases the full weights first
    other = make_trainer("zero2", 1)
    out["other_config"] = (
        ref_trainer.validate(ref, token_data(8), verbose=False)[0]["val_loss"],
        other.validate(module, token_data(8), verbose=False)[0]["val_loss"],
    )
    out["released"] = linked_engine(module) is None and all(type(p) is torch.nn.Parameter for p in module.parameters())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("after_fit"))


@pytest.mark.parametrize("stage", [3, 2])
def test_no_phase_of_the_lifecycle_holds_more_than_the_fit_and_one_unit(results, stage):
    for rank, r in enumerate(results[f"lifecycle_zero{stage}"]):
        peaks, unit = r["peaks"], r["unit_bytes"] if stage == 3 else 0
        for phase, peak in peaks.items():
            if phase == "fit" or (phase == "full save" and rank == 0):
                continue
            # "resume" runs in the same processes, after the first run's module and Trainer were
            # dropped: they must really be freed (see `_weakly` in gather_schedule.py)
            margin = RESUME_MARGIN if phase == "resume" else MARGIN
            assert peak <= peaks["fit"] + unit + margin, (phase, (peak - peaks["fit"]) / 2**20)
        assert r["resumed_step"] == 3


@pytest.mark.parametrize("stage", [3, 2])
def test_rank_zero_holds_the_full_checkpoint_once_while_saving_it(results, stage):
    r = results[f"lifecycle_zero{stage}"][0]
    rise = r["peaks"]["full save"] - r["before"]["full save"]
    assert rise <= FULL_SAVE_FACTOR * r["file_bytes"], (rise / 2**20, r["file_bytes"] / 2**20)


def test_the_module_stays_sharded_after_fit_and_reads_and_writes_as_ddps(results):
    for r in results["after_fit"]:
        assert r["at_rest"] and r["at_rest_after_evaluation"]
        assert r["read_at_rest"][0] == r["read_at_rest"][1]
        assert r["write_at_rest"][0] == r["write_at_rest"][1] != r["read_at_rest"][0]
        assert r["weights"] == 0.0


def test_validate_and_predict_after_fit_reuse_the_shards_and_match_ddp(results):
    for r in results["after_fit"]:
        assert r["validate"][0] == r["validate"][1]
        assert r["predict"]


def test_summon_full_params_takes_fsdps_knobs(results):
    rank0, rank1 = results["after_fit"]
    assert rank0["rank0_copies"] == 0.0 and rank0["rank0_devices"] == {"cpu"}
    assert rank1["others_at_rest"]
    for r in (rank0, rank1):
        assert "rank0_only" in r["rank0_writeback"] and "writeback" in r["rank0_writeback"]
        assert r["written_back"] == 0.0


def test_a_full_file_saved_after_fit_is_ddps(results):
    r = results["after_fit"][0]
    assert r["file_weights"] == 0.0 and r["file_optimizer"] == 0.0


def test_a_second_fit_goes_on_from_the_shards_as_ddp_does(results):
    for r in results["after_fit"]:
        assert r["same_engine"]
        assert r["second_fit"] == 0.0


def test_another_configuration_takes_the_module_over_with_full_weights(results):
    for r in results["after_fit"]:
        assert r["other_config"][0] == r["other_config"][1]
        assert r["released"]


def test_a_module_dropped_after_fit_is_freed_with_its_engine_and_trainer(results):
    for r in results["dropped_after_fit"]:
        assert r["alive"] == [False, False, False]

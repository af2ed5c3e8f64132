"""Training-loop features and bad input under ZeroStrategy, against Lightning's DDP, 2 CPU ranks:
checkpoints interchangeable with DDP's, gradient accumulation, clipping, param groups with an LR
scheduler, and errors raised on every rank instead of hangs."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback
from lightning_helpers import fit_and_record

STEPS = 4
ZERO = ("zero1", "zero2", "zero3")
RESUME_CASES = [
    ("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "ddp"),
    ("ddp", "zero2_full"), ("zero1", "zero2_full"), ("zero3", "zero2_full"), ("ddp", "zero3_full"), ("zero2", "zero3_full"),
    ("zero1", "zero2_sharded"), ("zero2", "zero2_sharded"), ("zero3", "zero2_sharded"),
]


class _GradNorms(Callback):
    def __init__(self, lightning_helper: bool) -> None:
        self.lightning_helper = lightning_helper
        self.seen: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        norms = grad_norm(pl_module, 2) if self.lightning_helper else trainer.strategy.grad_norm(2)
        self.seen.append({k: v.item() for k, v in norms.items()})


def _frozen_model():
    from models import OddShapes

    model = OddShapes()
    model.requires_grad_(False)
    return model


GROUP = CaseGroup(world_size=2)


def _diffs(reference: list, history: list) -> list[float]:
    from lightning_helpers import max_abs_diff

    return [max_abs_diff(a, b) for a, b in zip(reference, history)]


# -- accumulation, clipping, param groups + scheduler: each vs DDP with the same settings
SETTINGS = {
    "accumulate_2": dict(accumulate_grad_batches=2),
    "clip_norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "two_groups_steplr": dict(module_kwargs={"optimizer": "two_groups_steplr"}),
}


def same_settings_as_ddp(ctx: RankContext, label: str, strategy: str) -> dict:
    """max |zero - ddp| after every step (every micro-batch when accumulating) under one loop
    setting, and the learning rates the param groups end with."""
    reference = ctx.once(f"ddp_{label}", lambda: fit_and_record("ddp", STEPS, **dict(SETTINGS[label]))[1])
    _, history, trainer = fit_and_record(strategy, STEPS, **dict(SETTINGS[label]))
    return {"diffs": _diffs(reference, history), "lr": [g["lr"] for g in trainer.optimizers[0].param_groups]}


for _label in SETTINGS:
    for _strategy in ZERO:
        GROUP.case(same_settings_as_ddp, name=f"{_label}_{_strategy}", label=_label, strategy=_strategy)


NONFINITE = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm", module_kwargs={"inf_at_batch": 1})


def nonfinite_norm(ctx: RankContext, strategy: str) -> list[bool]:
    """A non-finite gradient norm: clipping poisons the weights exactly as under DDP. Per step,
    whether the weights equal DDP's (NaN and inf compared as values), then whether DDP's weights
    went non-finite at all."""
    reference = ctx.once("ddp_nonfinite", lambda: fit_and_record("ddp", 3, **dict(NONFINITE))[1])
    _, history, _ = fit_and_record(strategy, 3, **dict(NONFINITE))
    return [
        all(torch.equal(a[k].nan_to_num(nan=7.0, posinf=8.0, neginf=9.0), b[k].nan_to_num(nan=7.0, posinf=8.0, neginf=9.0)) for k in a)
        for a, b in zip(reference, history)
    ] + [any(not torch.isfinite(t).all() for t in reference[-1].values())]


for _strategy in ZERO:
    GROUP.case(nonfinite_norm, name=f"nonfinite_{_strategy}", strategy=_strategy)


def grad_norm_helper(ctx: RankContext, strategy: str) -> tuple[list, list]:
    """Gradient norms: Lightning's helper under DDP, and the strategy's helper under ZeRO."""

    def ddp_norms() -> list:
        fit_and_record("ddp", 2, callbacks=[norms := _GradNorms(lightning_helper=True)])
        return norms.seen

    reference = ctx.once("ddp_grad_norms", ddp_norms)
    fit_and_record(strategy, 2, callbacks=[zero_norms := _GradNorms(lightning_helper=False)])
    return reference, zero_norms.seen


for _strategy in ZERO:
    GROUP.case(grad_norm_helper, name=f"grad_norm_{_strategy}", strategy=_strategy)


@GROUP.case
def zero1_accumulate_calls(ctx: RankContext) -> dict:
    """Stage 1 communicates nothing on micro-batches that only accumulate: collectives in a whole
    fit of 2 steps of 2 micro-batches."""
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    COLLECTIVE_STATS.reset()
    fit_and_record("zero1", 2, accumulate_grad_batches=2)
    return dict(COLLECTIVE_STATS.calls)


# -- checkpoints. state_dict_type="full" writes DDP's format; the default sharded directories
# hold the same state; each kind resumes under every strategy as DDP resumes from its own
def _checkpointed_run(ctx: RankContext, label: str) -> tuple[list, str]:
    """Fit 6 steps saving every epoch under the strategy ``label`` names (once per rank): the
    weights after every step and the checkpoint after the first epoch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_zero

    strategies = {
        "ddp": lambda: "ddp",
        "zero2_full": lambda: lightning_zero.ZeroStrategy(stage=2, state_dict_type="full"),
        "zero3_full": lambda: lightning_zero.ZeroStrategy(stage=3, state_dict_type="full"),
        "zero2_sharded": lambda: "zero2",
    }

    def run() -> tuple[list, str]:
        dirpath = os.path.join(ctx.tmpdir, label)
        ckpt = ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1)
        _, history, _ = fit_and_record(strategies[label](), 6, data_size=16, callbacks=[ckpt], enable_checkpointing=True)
        return history, os.path.join(dirpath, "epoch=0-step=2.ckpt")  # 16 samples / 2 ranks / 4 = 2 steps per epoch

    return ctx.once(f"checkpointed_{label}", run)


def full_checkpoint(ctx: RankContext, stage: int) -> dict:
    """A full checkpoint: the run that wrote it vs DDP's, and (on rank 0, which reads both files)
    its optimizer state and weights vs DDP's checkpoint."""
    from lightning_helpers import max_abs_diff

    ddp_history, ddp_ckpt = _checkpointed_run(ctx, "ddp")
    history, path = _checkpointed_run(ctx, f"zero{stage}_full")
    out = {"uninterrupted": _diffs(ddp_history, history)}
    if ctx.rank == 0:
        saved = [torch.load(p, weights_only=False) for p in (ddp_ckpt, path)]
        states = [s["optimizer_states"][0]["state"] for s in saved]
        other = states[1]
        out["optimizer_state_diff"] = max(
            (states[0][i][k].float() - other[i][k].float()).abs().max().item() for i in states[0] for k in states[0][i]
        )
        out["optimizer_state_keys_equal"] = states[0].keys() == other.keys() and all(
            states[0][i].keys() == other[i].keys() for i in states[0]
        )
        out["weights_diff"] = max_abs_diff(saved[0]["state_dict"], saved[1]["state_dict"])
    return out


for _stage in (2, 3):
    GROUP.case(full_checkpoint, name=f"ckpt_full_zero{_stage}", stage=_stage)


@GROUP.case
def ckpt_sharded(ctx: RankContext) -> dict:
    """The default sharded checkpoint: a directory, and the run that wrote it vs DDP's."""
    ddp_history, _ = _checkpointed_run(ctx, "ddp")
    history, path = _checkpointed_run(ctx, "zero2_sharded")
    return {"uninterrupted": _diffs(ddp_history, history), "is_directory": os.path.isdir(path)}


def resume(ctx: RankContext, resumed: str, saved_by: str) -> list[float]:
    """max |resumed - reference| after every step, resuming under ``resumed`` from the checkpoint
    ``saved_by`` wrote."""
    # the reference is DDP resumed from DDP's checkpoint, so Lightning's own resume semantics
    # (e.g. how it re-enters an epoch) are the same on both sides
    ddp_ckpt = _checkpointed_run(ctx, "ddp")[1]
    reference = ctx.once("ddp_resumed", lambda: fit_and_record("ddp", 6, data_size=16, ckpt_path=ddp_ckpt)[1])
    _, history, _ = fit_and_record(resumed, 6, data_size=16, ckpt_path=_checkpointed_run(ctx, saved_by)[1])
    return _diffs(reference, history)


for _resumed, _saved_by in RESUME_CASES:
    GROUP.case(resume, name=f"resume_{_resumed}_from_{_saved_by}", resumed=_resumed, saved_by=_saved_by)


# -- bad input fails on every rank, with a message, and leaves the ranks usable
BAD_INPUT = {
    "frozen": dict(module_kwargs={"make_model": _frozen_model}),
    "lbfgs": dict(module_kwargs={"optimizer": "lbfgs"}),
    "not_an_optimizer": dict(module_kwargs={"optimizer": "not_an_optimizer"}),
    "foreign_tensor": dict(module_kwargs={"optimizer": "foreign_tensor"}),
    # a URL (fsspec's in-memory filesystem stands for object storage) is never taken for a local
    # path, which would make a local folder `memory:`: a checkpoint missing there is named as missing
    "remote_resume": dict(ckpt_path="memory://run/last.ckpt"),
}


def bad_input(ctx: RankContext, label: str) -> Optional[str]:
    """What fitting under zero2 with one kind of bad input raises (None if nothing does)."""
    try:
        fit_and_record("zero2", 2, **BAD_INPUT[label])
    except Exception as err:  # noqa: BLE001 - the message is what we test
        return f"{type(err).__name__}: {err}"
    return None


for _label in BAD_INPUT:
    GROUP.case(bad_input, name=f"error_{_label}", label=_label)


@GROUP.case
def usable_after_errors(ctx: RankContext) -> int:
    """Steps a plain zero2 fit records after the bad-input cases failed on these ranks."""
    _, history, _ = fit_and_record("zero2", 1)
    return len(history)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("ckpts"))


def test_stage1_accumulation_bitwise_and_silent_between_steps(results):
    for r in results["accumulate_2_zero1"]:
        assert r["diffs"] == [0.0] * 2 * STEPS  # weights after every micro-batch
    # 2 steps of 2 micro-batches, 1 bucket: a reduce-scatter and an all-gather per step (not per
    # micro-batch), and the broadcast of rank 0's weights at setup
    assert results["zero1_accumulate_calls"][0] == {"reduce_scatter": 2, "all_gather": 2, "broadcast": 1}


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_stage2_and_3_accumulation_close_to_ddp(results, name):
    # Stages 2-3 reduce-scatter each micro-batch (keeping gradients sharded), so they sum
    # (g1/N + g2/N) across ranks where DDP sums (g1 + g2)/N: a different order of float additions.
    for r in results[f"accumulate_2_{name}"]:
        assert max(r["diffs"]) <= 1e-6


def test_clip_by_value_bitwise(results):
    for name in ("zero1", "zero2", "zero3"):
        for r in results[f"clip_value_{name}"]:
            assert r["diffs"] == [0.0] * STEPS


def test_clip_by_norm_uses_global_norm(results):
    # The global norm is summed from per-shard norms, DDP's from per-tensor norms: the same
    # quantity with a different rounding, hence 1e-6 rather than bitwise.
    for name in ("zero1", "zero2", "zero3"):
        for r in results[f"clip_norm_{name}"]:
            assert max(r["diffs"]) <= 1e-6


def test_param_groups_and_scheduler(results):
    for name in ("zero1", "zero2", "zero3"):
        for r in results[f"two_groups_steplr_{name}"]:
            assert r["diffs"] == [0.0] * STEPS
            assert r["lr"] == [1e-2 * 0.5**STEPS, 3e-2 * 0.5**STEPS]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_full_checkpoint_matches_ddp_format_and_values(results, name):
    on_rank_0 = results[f"ckpt_full_{name}"][0]
    assert on_rank_0["optimizer_state_keys_equal"]
    assert on_rank_0["optimizer_state_diff"] == 0.0
    assert on_rank_0["weights_diff"] == 0.0
    for r in results[f"ckpt_full_{name}"]:
        assert r["uninterrupted"] == [0.0] * 6


def test_sharded_checkpoint_is_a_directory_and_changes_nothing(results):
    for r in results["ckpt_sharded"]:
        assert r["is_directory"]
        assert r["uninterrupted"] == [0.0] * 6


@pytest.mark.parametrize("resumed,saved_by", RESUME_CASES)
def test_resume_across_strategies_is_exact(results, resumed, saved_by):
    for diffs in results[f"resume_{resumed}_from_{saved_by}"]:
        assert diffs == [0.0] * 4


@pytest.mark.parametrize(
    "label,expected",
    [
        ("frozen", "no parameter with `requires_grad=True`"),
        ("lbfgs", "LBFGS re-evaluates the loss several times per step"),
        ("not_an_optimizer", "optimizer"),
        ("foreign_tensor", "not a parameter of the module"),
        ("remote_resume", "Checkpoint 'memory://run/last.ckpt' does not exist"),
    ],
)
def test_bad_input_raises_on_every_rank(results, label, expected):
    for message, steps_after in zip(results[f"error_{label}"], results["usable_after_errors"]):
        assert message is not None and expected in message, message
        assert steps_after == 1
    assert not os.path.exists("memory:"), "a URL became a local folder"


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_grad_norm_helper_matches_lightnings_under_ddp(results, name):
    for ddp, zero in results[f"grad_norm_{name}"]:
        assert len(ddp) == len(zero) == 2
        for expected, got in zip(ddp, zero):
            assert expected.keys() == got.keys()
            for key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-5), key


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_non_finite_norm_handled_as_ddp(results, name):
    for r in results[f"nonfinite_{name}"]:
        *same_per_step, reference_went_non_finite = r
        assert reference_went_non_finite  # the case is real: DDP's weights became NaN
        assert same_per_step == [True] * 3

"""Training-loop features and bad input under ZeroStrategy, against Lightning's DDP, 2 CPU ranks:
checkpoints interchangeable with DDP's, gradient accumulation, clipping, param groups with an LR
scheduler, and errors raised on every rank instead of hangs."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from multiprocess import run_on_ranks

STEPS = 4
RESUME_CASES = [
    ("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "ddp"),
    ("ddp", "zero2_full"), ("zero1", "zero2_full"), ("zero3", "zero2_full"), ("ddp", "zero3_full"), ("zero2", "zero3_full"),
    ("zero1", "zero2_sharded"), ("zero2", "zero2_sharded"), ("zero3", "zero2_sharded"),
]


def _loop_cases(rank: int, world_size: int, tmpdir: str) -> dict:
    import lightning_zero
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record, max_abs_diff

    from lightning_zero.engine.collectives import COLLECTIVE_STATS

    out: dict = {}

    def diffs(reference, history):
        return [max_abs_diff(a, b) for a, b in zip(reference, history)]

    # -- accumulation, clipping, param groups + scheduler: each vs DDP with the same settings
    settings = {
        "accumulate_2": dict(accumulate_grad_batches=2),
        "clip_norm": dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
        "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
        "two_groups_steplr": dict(module_kwargs={"optimizer": "two_groups_steplr"}),
    }
    for label, kwargs in settings.items():
        _, reference, _ = fit_and_record("ddp", STEPS, **dict(kwargs))
        for name in ("zero1", "zero2", "zero3"):
            _, history, trainer = fit_and_record(name, STEPS, **dict(kwargs))
            out[(label, name)] = diffs(reference, history)
            if label == "two_groups_steplr":
                out[(label, name, "lr")] = [g["lr"] for g in trainer.optimizers[0].param_groups]

    # -- a non-finite gradient norm: clipping poisons the weights exactly as under DDP
    nonfinite = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm", module_kwargs={"inf_at_batch": 1})
    _, reference, _ = fit_and_record("ddp", 3, **dict(nonfinite))
    for name in ("zero1", "zero2", "zero3"):
        _, history, _ = fit_and_record(name, 3, **dict(nonfinite))
        out[("nonfinite", name)] = [
            all(torch.equal(a[k].nan_to_num(nan=7.0, posinf=8.0, neginf=9.0), b[k].nan_to_num(nan=7.0, posinf=8.0, neginf=9.0)) for k in a)
            for a, b in zip(reference, history)
        ] + [any(not torch.isfinite(t).all() for t in reference[-1].values())]

    # -- gradient norms: Lightning's helper under DDP == the strategy's helper under ZeRO
    _, _, _ = fit_and_record("ddp", 2, callbacks=[ddp_norms := _GradNorms(lightning_helper=True)])
    for name in ("zero1", "zero2", "zero3"):
        fit_and_record(name, 2, callbacks=[zero_norms := _GradNorms(lightning_helper=False)])
        out[("grad_norm", name)] = (ddp_norms.seen, zero_norms.seen)

    # -- stage 1 communicates nothing on micro-batches that only accumulate
    COLLECTIVE_STATS.reset()
    fit_and_record("zero1", 2, accumulate_grad_batches=2)
    out["zero1_accumulate_calls"] = dict(COLLECTIVE_STATS.calls)

    # -- checkpoints. state_dict_type="full" writes DDP's format; the default sharded directories
    # hold the same state; each kind resumes under every strategy as DDP resumes from its own
    def checkpointed_run(label: str, strategy) -> tuple[list, str]:
        dirpath = os.path.join(tmpdir, label)
        ckpt = ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1)
        _, history, _ = fit_and_record(strategy, 6, data_size=16, callbacks=[ckpt], enable_checkpointing=True)
        return history, os.path.join(dirpath, "epoch=0-step=2.ckpt")  # 16 samples / 2 ranks / 4 = 2 steps per epoch

    ddp_history, ddp_ckpt = checkpointed_run("ddp", "ddp")
    full = {}
    for stage in (2, 3):
        history, full[stage] = checkpointed_run(f"zero{stage}_full", lightning_zero.ZeroStrategy(stage=stage, state_dict_type="full"))
        out[f"ckpt_uninterrupted_zero{stage}"] = diffs(ddp_history, history)
    sharded_history, sharded_ckpt = checkpointed_run("zero2_sharded", "zero2")
    out["ckpt_uninterrupted_sharded"] = diffs(ddp_history, sharded_history)
    out["sharded_is_directory"] = os.path.isdir(sharded_ckpt)
    if rank == 0:
        saved = [torch.load(p, weights_only=False) for p in (ddp_ckpt, full[2], full[3])]
        states = [s["optimizer_states"][0]["state"] for s in saved]
        for name, other, ckpt in (("zero2", states[1], saved[1]), ("zero3", states[2], saved[2])):
            out[("ckpt_optimizer_state_diff", name)] = max(
                (states[0][i][k].float() - other[i][k].float()).abs().max().item() for i in states[0] for k in states[0][i]
            )
            out[("ckpt_optimizer_state_keys_equal", name)] = states[0].keys() == other.keys() and all(
                states[0][i].keys() == other[i].keys() for i in states[0]
            )
            out[("ckpt_weights_diff", name)] = max_abs_diff(saved[0]["state_dict"], ckpt["state_dict"])
    # the reference is DDP resumed from DDP's checkpoint, so Lightning's own resume semantics
    # (e.g. how it re-enters an epoch) are the same on both sides
    _, reference, _ = fit_and_record("ddp", 6, data_size=16, ckpt_path=ddp_ckpt)
    sources = {"ddp": ddp_ckpt, "zero2_full": full[2], "zero3_full": full[3], "zero2_sharded": sharded_ckpt}
    for resumed_name, saved_by in RESUME_CASES:
        _, history, _ = fit_and_record(resumed_name, 6, data_size=16, ckpt_path=sources[saved_by])
        out[("resume", resumed_name, saved_by)] = diffs(reference, history)

    # -- bad input fails on every rank, with a message, and leaves the ranks usable
    for label, kwargs in {
        "frozen": dict(module_kwargs={"make_model": _frozen_model}),
        "lbfgs": dict(module_kwargs={"optimizer": "lbfgs"}),
        "not_an_optimizer": dict(module_kwargs={"optimizer": "not_an_optimizer"}),
        "foreign_tensor": dict(module_kwargs={"optimizer": "foreign_tensor"}),
    }.items():
        try:
            fit_and_record("zero2", 2, **kwargs)
            out[("error", label)] = None
        except Exception as err:  # noqa: BLE001 - the message is what we test
            out[("error", label)] = f"{type(err).__name__}: {err}"
    _, history, _ = fit_and_record("zero2", 1)
    out["usable_after_errors"] = len(history)
    return out


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


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_loop_cases, str(tmp_path_factory.mktemp("ckpts")), world_size=2, init_process_group=False)


def test_stage1_accumulation_bitwise_and_silent_between_steps(results):
    for r in results:
        assert r[("accumulate_2", "zero1")] == [0.0] * 2 * STEPS  # weights after every micro-batch
    # 2 steps of 2 micro-batches, 1 bucket: a reduce-scatter and an all-gather per step (not per
    # micro-batch), and the broadcast of rank 0's weights at setup
    assert results[0]["zero1_accumulate_calls"] == {"reduce_scatter": 2, "all_gather": 2, "broadcast": 1}


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_stage2_and_3_accumulation_close_to_ddp(results, name):
    # Stages 2-3 reduce-scatter each micro-batch (keeping gradients sharded), so they sum
    # (g1/N + g2/N) across ranks where DDP sums (g1 + g2)/N: a different order of float additions.
    for r in results:
        assert max(r[("accumulate_2", name)]) <= 1e-6


def test_clip_by_value_bitwise(results):
    for r in results:
        for name in ("zero1", "zero2", "zero3"):
            assert r[("clip_value", name)] == [0.0] * STEPS


def test_clip_by_norm_uses_global_norm(results):
    # The global norm is summed from per-shard norms, DDP's from per-tensor norms: the same
    # quantity with a different rounding, hence 1e-6 rather than bitwise.
    for r in results:
        for name in ("zero1", "zero2", "zero3"):
            assert max(r[("clip_norm", name)]) <= 1e-6


def test_param_groups_and_scheduler(results):
    for r in results:
        for name in ("zero1", "zero2", "zero3"):
            assert r[("two_groups_steplr", name)] == [0.0] * STEPS
            assert r[("two_groups_steplr", name, "lr")] == [1e-2 * 0.5**STEPS, 3e-2 * 0.5**STEPS]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_full_checkpoint_matches_ddp_format_and_values(results, name):
    assert results[0][("ckpt_optimizer_state_keys_equal", name)]
    assert results[0][("ckpt_optimizer_state_diff", name)] == 0.0
    assert results[0][("ckpt_weights_diff", name)] == 0.0
    for r in results:
        assert r[f"ckpt_uninterrupted_{name}"] == [0.0] * 6


def test_sharded_checkpoint_is_a_directory_and_changes_nothing(results):
    for r in results:
        assert r["sharded_is_directory"]
        assert r["ckpt_uninterrupted_sharded"] == [0.0] * 6


@pytest.mark.parametrize("resumed,saved_by", RESUME_CASES)
def test_resume_across_strategies_is_exact(results, resumed, saved_by):
    for r in results:
        assert r[("resume", resumed, saved_by)] == [0.0] * 4


@pytest.mark.parametrize(
    "label,expected",
    [
        ("frozen", "no parameter with `requires_grad=True`"),
        ("lbfgs", "LBFGS is not element-wise"),
        ("not_an_optimizer", "optimizer"),
        ("foreign_tensor", "not a parameter of the module"),
    ],
)
def test_bad_input_raises_on_every_rank(results, label, expected):
    for r in results:
        assert r[("error", label)] is not None and expected in r[("error", label)], r[("error", label)]
        assert r["usable_after_errors"] == 1


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_grad_norm_helper_matches_lightnings_under_ddp(results, name):
    for r in results:
        ddp, zero = r[("grad_norm", name)]
        assert len(ddp) == len(zero) == 2
        for expected, got in zip(ddp, zero):
            assert expected.keys() == got.keys()
            for key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-5), key


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_non_finite_norm_handled_as_ddp(results, name):
    for r in results:
        *same_per_step, reference_went_non_finite = r[("nonfinite", name)]
        assert reference_went_non_finite  # the case is real: DDP's weights became NaN
        assert same_per_step == [True] * 3

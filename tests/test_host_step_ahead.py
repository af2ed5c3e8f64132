"""The host step during backward (issue 53): with ``offload_optimizer=True`` each bucket's optimizer step
runs on a host thread as its reduced gradients land, and ``optimizer.step()`` commits it or rolls it back
(see [Note: the host step during backward] in ``engine/offload/step_ahead.py``).

Every case fits the same run twice, with ``overlap_host_step=True`` and with ``False`` (the whole host
step after backward, as before), both with the default fused host kernel, and compares the weights after
every step bitwise; ``host_step_report()`` says how each step was taken (ahead, redone, after backward,
and why). One group of 2 ranks; runs with the same settings are fitted once (``ctx.once``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import GPTModule

from lightning_zero.engine.offload.backoff import BACKOFF_REASON

STEPS = 3
VARIANTS = {
    "zero1_offload": {"stage": 1, "offload_optimizer": True},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}
PRECISIONS = ("32-true", "bf16-mixed")
CLIP_NORM = 1.0
"""Between the total gradient norms of the clipping case's steps (recorded there): some clip, some not."""
SMALL_BUCKETS = {"bucket_size_mb": 0.01}
"""About one GPT block per bucket, so that a backward lands several buckets one after the other."""
SLEEP_S = 0.15
"""Each of the two sleeps in ``SlowFirstBlockGPT``'s backward (an order, not a timing, is asserted)."""

GROUP = CaseGroup(world_size=2)


# ---- what the runs record ---------------------------------------------------------------------------


MODES = ("ahead", "redone", "after_backward")


def _counts(report) -> tuple[int, int, int]:
    return (0, 0, 0) if report is None else (report.ahead, report.redone, report.after_backward)


def _mode_taken(before, after) -> Optional[str]:
    """How the step taken between two host-step reports was taken (None: no step was counted)."""
    taken = [mode for mode, a, b in zip(MODES, _counts(before), _counts(after)) if b > a]
    assert len(taken) <= 1, (before, after)
    return taken[0] if taken else None


class HostSteps(Callback):
    """After every batch: the engine's host-step report, how this batch's step was taken (None where
    it took none) and the rollback bytes. Overrides no hook between backward and the step, so it does
    not change how steps are planned."""

    def __init__(self) -> None:
        self.modes: list[Optional[str]] = []
        self.rollback: list[int] = []
        self.report = None
        self.copied_back = 0
        """Buckets whose weights went back to the device on the host step's thread (copies back per bucket)."""

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        engine = trainer.strategy.engine
        report = engine.host_step_report()
        self.modes.append(_mode_taken(self.report, report))
        self.report = report
        self.rollback.append(trainer.strategy.memory_report().host_step_rollback)
        copies = engine.residency.copies_back
        if copies is not None:
            self.copied_back = copies.sent_early if hasattr(copies, "sent_early") else copies.refreshed_early


def _wait_for_host_step(engine) -> None:
    """Wait until the host thread has stepped every bucket that arrived in this backward (all have by
    the end of backward). What the caller changes next then comes after the steps taken ahead, as where
    the host step hides under a long backward, so the verdict must see it: without the wait the host
    thread may step after the change, read the changed values and keep the step, also correct but not
    the path under test."""
    engine.wait_for_host_step()


class WaitForHostStep(Callback):
    """``_wait_for_host_step`` between backward and the optimizer step (before clipping)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        _wait_for_host_step(trainer.strategy.engine)


class GradNorms(Callback):
    """The total norm of each step's gradients before clipping (a collective: every rank reads it)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(trainer.strategy.engine.grad_norms(2.0)["total"].item())


class EditGradients(Callback):
    """Halves the gradients between backward and the step on steps 1 and 2 (0 and 3 are left alone),
    through ``param.grad`` as users do: ``in_place`` (``p.grad.mul_(0.5)``, after the host step
    taken ahead: ``_wait_for_host_step``), else by assigning ``p.grad = p.grad * 0.5`` (which reaches
    the optimizer at ``optimizer.step()``, whenever the host thread stepped)."""

    def __init__(self, in_place: bool) -> None:
        self.in_place = in_place

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step not in (1, 2):
            return
        if self.in_place:
            _wait_for_host_step(trainer.strategy.engine)
        for p in pl_module.parameters():
            if p.grad is None:
                continue
            if self.in_place:
                p.grad.mul_(0.5)
            else:
                p.grad = p.grad * 0.5


class HalveLearningRate(Callback):
    """Halves the learning rate between backward and the step of step 1 (it stays halved), after the
    host step taken ahead."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 1:
            _wait_for_host_step(trainer.strategy.engine)
            for group in optimizer.param_groups:
                group["lr"] *= 0.5


class ScheduledGPT(GPTModule):
    """An LR scheduler stepping after every optimizer step (between one step's backward and the next)."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TorchClippingGPT(GPTModule):
    """Clips in ``configure_gradient_clipping`` with torch's own ``clip_grad_norm_`` on the module's
    parameters, as code written for DDP does."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        _wait_for_host_step(self.trainer.strategy.engine)
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP_NORM)


class ManualGPT(GPTModule):
    """One optimizer, stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


class AdafactorGPT(GPTModule):
    """A whole-tensor optimizer (factored second moments): it steps whole tensors on owner ranks."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


class InfOnRank1GPT(GPTModule):
    """Rank 1's loss is inf at batch 1: under loss scaling every rank skips that step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 1 and self.global_rank == 1 else loss


class _SlowBackward(torch.autograd.Function):
    """The identity; its backward sleeps (a long device backward that leaves the host free)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


class SlowFirstBlockGPT(GPTModule):
    """Backward sleeps on both sides of the first block: before its gradients accumulate (the later
    blocks' buckets are reduced by then) and after (while they step on the host thread)."""

    def __init__(self) -> None:
        super().__init__()
        block = self.model.blocks[0]
        block.register_forward_pre_hook(lambda module, args: (_SlowBackward.apply(args[0]), *args[1:]))
        block.register_forward_hook(lambda module, args, out: _SlowBackward.apply(out))


MODULES = {
    "gpt": GPTModule,
    "scheduled": ScheduledGPT,
    "torch_clipping": TorchClippingGPT,
    "manual": ManualGPT,
    "adafactor": AdafactorGPT,
    "inf_on_rank1": InfOnRank1GPT,
    "slow": SlowFirstBlockGPT,
}


def _fit(
    args: dict,
    overlap: bool,
    steps: int = STEPS,
    module: str = "gpt",
    callbacks: tuple = (),
    ckpt_path: Optional[str] = None,
    samples: int = 32,
    **trainer_kwargs: Any,
) -> dict:
    """One fit of ``MODULES[module]`` under ``ZeroStrategy(**args, overlap_host_step=overlap)``: the
    weights after every batch and what ``HostSteps`` saw. ``samples``: of ``token_data``, 8 batches of
    2 per rank by default."""
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer, token_data

    import lightning_zero

    L.seed_everything(0, verbose=False)
    seen, recorder = HostSteps(), WeightRecorder()
    strategy = lightning_zero.ZeroStrategy(**args, overlap_host_step=overlap)
    trainer = make_trainer(strategy, steps, callbacks=[recorder, seen, *callbacks], **trainer_kwargs)
    trainer.fit(MODULES[module](), token_data(samples), ckpt_path=ckpt_path)
    return {
        "history": recorder.history,
        "modes": seen.modes,
        "rollback": seen.rollback,
        "report": seen.report,
        "copied_back": seen.copied_back,
    }


def _diffs(a: list, b: list) -> Optional[list[float]]:
    """max |a - b| after each batch (None where the runs made different numbers of batches)."""
    from lightning_helpers import max_abs_diff

    return [max_abs_diff(x, y) for x, y in zip(a, b)] if len(a) == len(b) and a else None


def _twins(ctx: RankContext, key: Any, args: dict, **kwargs: Any) -> dict:
    """The run with ``overlap_host_step=True`` and its twin with False (fitted once per ``key``)."""
    ahead = _fit(args, True, **kwargs)
    after = ctx.once(("after", key), lambda: _fit(args, False, **kwargs))
    return {"diffs": _diffs(after["history"], ahead["history"]), "ahead": ahead, "after": after}


def _summary(twins: dict) -> dict:
    """What the tests read of a pair of runs (the histories stay on the ranks)."""
    ahead, after = twins["ahead"], twins["after"]
    return {
        "diffs": twins["diffs"],
        "modes": ahead["modes"],
        "rollback": ahead["rollback"],
        "report": ahead["report"],
        "report_without_overlap": after["report"],
        "copied_back": ahead["copied_back"],
    }


# ---- 1. plain runs at every stage, fp32 and bf16-mixed -----------------------------------------------


def plain(ctx: RankContext, label: str, precision: str) -> dict:
    return _summary(_twins(ctx, (label, precision), VARIANTS[label], precision=precision))


for _label in VARIANTS:
    for _precision in PRECISIONS:
        GROUP.case(plain, name=f"plain_{_label}_{_precision}", label=_label, precision=_precision)


# ---- 2. clipping by norm that applies on some steps ----------------------------------------------------


@GROUP.case
def clip_norm(ctx: RankContext) -> dict:
    """Clipping by norm at ``CLIP_NORM``, after the host step taken ahead; the reference run records
    each step's gradient norm."""
    norms = GradNorms()
    args = VARIANTS["zero2_offload"]
    options = dict(steps=4, gradient_clip_val=CLIP_NORM)
    after = _fit(args, False, callbacks=(norms,), **options)
    ahead = _fit(args, True, callbacks=(WaitForHostStep(),), **options)
    return {**_summary({"diffs": _diffs(after["history"], ahead["history"]), "ahead": ahead, "after": after}), "norms": norms.norms}


@GROUP.case
def clip_value(ctx: RankContext) -> dict:
    """Clipping by value edits every gradient it clamps: the Trainer takes those steps after backward."""
    return _summary(_twins(ctx, "clip_value", VARIANTS["zero2_offload"], gradient_clip_val=0.01, gradient_clip_algorithm="value"))


@GROUP.case
def torch_clipping_in_hook(ctx: RankContext) -> dict:
    """torch's ``clip_grad_norm_`` over ``param.grad`` in ``configure_gradient_clipping``."""
    return _summary(_twins(ctx, "torch_clipping", VARIANTS["zero2_offload"], steps=4, module="torch_clipping"))


# ---- 3. gradient accumulation ------------------------------------------------------------------------


@GROUP.case
def accumulate_4(ctx: RankContext) -> dict:
    return _summary(_twins(ctx, "accumulate_4", VARIANTS["zero2_offload"], steps=2, accumulate_grad_batches=4))


# ---- 4. a callback that edits gradients between backward and the step -------------------------------


def edit_gradients(ctx: RankContext, in_place: bool) -> dict:
    key = ("edit_gradients", in_place)
    return _summary(_twins(ctx, key, VARIANTS["zero3_offload"], steps=4, callbacks=(EditGradients(in_place),)))


GROUP.case(edit_gradients, name="assign_gradients", in_place=False)
GROUP.case(edit_gradients, name="edit_gradients_in_place", in_place=True)


@GROUP.case
def learning_rate_changed(ctx: RankContext) -> dict:
    """A callback changes the learning rate between backward and the step."""
    return _summary(_twins(ctx, "learning_rate_changed", VARIANTS["zero2_offload"], steps=4, callbacks=(HalveLearningRate(),)))


@GROUP.case
def lr_scheduler(ctx: RankContext) -> dict:
    """A scheduler changes the learning rate after each step: the next step ahead reads the new one."""
    return _summary(_twins(ctx, "lr_scheduler", VARIANTS["zero3_offload"], module="scheduled"))


# ---- 5. manual optimization: one optimizer, and two -------------------------------------------------


@GROUP.case
def manual_one_optimizer(ctx: RankContext) -> dict:
    return _summary(_twins(ctx, "manual", VARIANTS["zero2_offload"], module="manual"))


@GROUP.case
def manual_two_optimizers(ctx: RankContext) -> dict:
    """``TwoOptimizerModule`` (a GAN-style generator and critic step per batch)."""
    import lightning as L
    from lightning_helpers import TwoOptimizerModule, WeightRecorder, make_trainer, regression_data

    import lightning_zero

    def fit(overlap: bool) -> dict:
        L.seed_everything(0, verbose=False)
        seen, recorder = HostSteps(), WeightRecorder()
        strategy = lightning_zero.ZeroStrategy(**VARIANTS["zero2_offload"], overlap_host_step=overlap)
        # `max_steps` counts both optimizers' steps: 2 batches
        make_trainer(strategy, 4, callbacks=[recorder, seen]).fit(TwoOptimizerModule(), regression_data())
        return {"history": recorder.history, "modes": seen.modes, "rollback": seen.rollback, "report": seen.report, "copied_back": seen.copied_back}

    ahead, after = fit(True), fit(False)
    return _summary({"diffs": _diffs(after["history"], ahead["history"]), "ahead": ahead, "after": after})


# ---- 6. a whole-tensor optimizer ---------------------------------------------------------------------


@GROUP.case
def whole_tensor_optimizer(ctx: RankContext) -> dict:
    return _summary(_twins(ctx, "adafactor", VARIANTS["zero3_offload"], module="adafactor"))


# ---- 16-mixed: loss scaling, an inf on one rank at one step --------------------------------------------


@GROUP.case
def loss_scaling_inf_on_one_rank(ctx: RankContext) -> dict:
    """``16-mixed`` on the CPU (a ``MixedPrecision`` plugin with a CPU ``GradScaler``; the flag itself
    would fall back to bf16-mixed there): rank 1's loss is inf at batch 1."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin() -> list:
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1))]

    class Scales(Callback):
        def __init__(self) -> None:
            self.scales: list[float] = []

        def on_train_batch_end(self, trainer, *args: Any) -> None:
            self.scales.append(trainer.strategy.precision_plugin.scaler.get_scale())

    scales = Scales(), Scales()
    after = _fit(VARIANTS["zero2_offload"], False, module="inf_on_rank1", callbacks=(scales[0],), plugins=plugin())
    ahead = _fit(VARIANTS["zero2_offload"], True, module="inf_on_rank1", callbacks=(scales[1],), plugins=plugin())
    summary = _summary({"diffs": _diffs(after["history"], ahead["history"]), "ahead": ahead, "after": after})
    history = ahead["history"]
    summary["moved"] = [_diffs([a], [b])[0] > 0 for a, b in zip(history, history[1:])]
    return {**summary, "scales": scales[1].scales, "scales_without_overlap": scales[0].scales}


# ---- 7. sharded save and resume mid-run ---------------------------------------------------------------


@GROUP.case
def save_and_resume(ctx: RankContext) -> dict:
    """4 steps with overlap, a sharded checkpoint after step 2; steps 3-4 resumed from it with
    overlap; against the uninterrupted run without overlap. An epoch is 2 steps here, so the resumed
    run sees the batches the uninterrupted one did (a plain DataLoader restarts its epoch on resume)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    args, options = VARIANTS["zero3_offload"], dict(steps=4, samples=8)
    dirpath = os.path.join(ctx.tmpdir, "save_and_resume")
    saving = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    saved = _fit(args, True, callbacks=(saving,), enable_checkpointing=True, **options)
    resumed = _fit(args, True, ckpt_path=os.path.join(dirpath, "step=2.ckpt"), **options)
    after = _fit(args, False, **options)
    return {
        "saved": _diffs(after["history"], saved["history"]),
        "resumed": _diffs(after["history"][2:], resumed["history"]),
        "report": resumed["report"],
        "is_directory": os.path.isdir(os.path.join(dirpath, "step=2.ckpt")),
    }


# ---- 8. NVMe offload: the state in files steps during backward too ------------------------------------


@GROUP.case
def nvme(ctx: RankContext) -> dict:
    """The optimizer state in files steps during backward as CPU offload does (the state through its
    files' slots, ``offload/disk_step_ahead.py``): the same bits as CPU offload stepping after backward
    (the fuller cases are ``test_nvme_step_ahead.py``'s)."""
    path = os.path.join(ctx.tmpdir, f"nvme_{ctx.rank}")
    os.makedirs(path, exist_ok=True)
    args = {**VARIANTS["zero2_offload"], "offload_optimizer": "nvme", "nvme_path": path}
    on_disk = _fit(args, True)
    in_memory = ctx.once(("after", ("zero2_offload", "32-true")), lambda: _fit(VARIANTS["zero2_offload"], False))
    return {"diffs": _diffs(in_memory["history"], on_disk["history"]), "report": on_disk["report"], "modes": on_disk["modes"]}


# ---- event order: a slow backward overlaps the host step -------------------------------------------


def slow_backward(ctx: RankContext, clip: bool) -> dict:
    """Backward sleeps around the first block (see ``SlowFirstBlockGPT``); small buckets. ``clip``: clipping
    by norm forced on every step (a tiny ``gradient_clip_val``), so every step is rolled back and redone."""
    args = {**VARIANTS["zero2_offload"], **SMALL_BUCKETS}
    options = dict(steps=1 if clip else 2, gradient_clip_val=1e-4 if clip else None)  # a redo backs off the next
    ahead = _fit(args, True, module="slow", **options)
    after = ctx.once(("after", "small buckets", clip), lambda: _fit(args, False, **options))
    last = ahead["report"].last
    return {
        **_summary({"diffs": _diffs(after["history"], ahead["history"]), "ahead": ahead, "after": after}),
        "first_start": min(start for _, start, _ in last.buckets) if last.buckets else None,
        "backward_end": last.backward_end,
        "buckets": [index for index, _, _ in last.buckets],
    }


GROUP.case(slow_backward, name="slow_backward", clip=False)
GROUP.case(slow_backward, name="slow_backward_clipped", clip=True)


# ---- the engine without a Trainer: loss scaling, an inf on rank 1 -----------------------------------------


def engine_loss_scaling(ctx: RankContext, stage: int) -> dict:
    """``ZeroEngine`` driven by hand through a ``ZeroGradScaler`` with the step planned ahead and
    rollback copies kept; rank 1's loss is inf at step 1 (every rank skips it). Against the same loop
    with ``overlap_host_step=False``: the weights after every step, and the scales."""
    import torch.distributed as dist
    from lightning_helpers import token_data

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
    from lightning_zero.models.gpt import GPT, GPTConfig

    if not dist.is_initialized():  # else made by a Trainer in an earlier case
        dist.init_process_group("gloo")
    data = [batch[0] for batch in token_data()][ctx.rank :: ctx.world_size]
    offload = {"offload_optimizer": True, "offload_params": True} if stage == 3 else {"offload_optimizer": True}

    def run(overlap: bool) -> dict:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, overlap_host_step=overlap, **offload, **SMALL_BUCKETS))
        if overlap:
            engine.plan_host_step(ahead=True, keep_rollback=True)
        scaler = ZeroGradScaler("cpu", init_scale=1024.0, growth_interval=1)
        out: dict = {"history": [], "scales": [], "modes": []}
        previous = None
        try:
            for step in range(4):
                tokens = data[step]
                engine.begin_step()
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
                if step == 1 and ctx.rank == 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                engine.finish_backward()
                engine.end_step()
                _wait_for_host_step(engine)  # unscaling comes after the steps taken ahead
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
                engine.after_optimizer_step(optimizer)
                optimizer.zero_grad()
                out["scales"].append(scaler.get_scale())
                out["history"].append(engine.full_state_dict(model))
                report = engine.host_step_report()
                out["modes"].append(_mode_taken(previous, report))
                previous = report
            out["report"] = engine.host_step_report()
        finally:
            engine.close()
        return out

    ahead, after = run(True), run(False)
    history = ahead["history"]
    return {
        "diffs": _diffs(after["history"], ahead["history"]),
        "moved": [_diffs([a], [b])[0] > 0 for a, b in zip(history, history[1:])],
        "scales": ahead["scales"],
        "scales_without_overlap": after["scales"],
        "modes": ahead["modes"],
        "report": ahead["report"],
        "report_without_overlap": after["report"],
    }


GROUP.case(engine_loss_scaling, name="engine_loss_scaling_stage2", stage=2)
GROUP.case(engine_loss_scaling, name="engine_loss_scaling_stage3", stage=3)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_step_ahead"))


# ---- the tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_plain_runs_step_during_backward_bitwise(results, label, precision):
    for r in results[f"plain_{label}_{precision}"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (STEPS, 0, 0), report
        assert report.reasons == {} and r["modes"] == ["ahead"] * STEPS
        # nothing between backward and the step can change it: no rollback copy is kept
        assert r["rollback"] == [0] * STEPS and report.rollback_bytes == 0
        assert report.content_checks == 0  # no user code between backward and the step: versions tell
        last = report.last
        assert last.buckets and last.backward_end is not None and last.host_step_s > 0
        assert r["report_without_overlap"] is None  # overlap_host_step=False: no step ahead at all
        if label != "zero3_offload":  # no hook between backward and the step: the write-backs left as each bucket stepped
            assert r["copied_back"] > 0, r


def test_clipping_redoes_the_steps_it_applies_to(results):
    for r in results["clip_norm"]:
        assert r["diffs"] == [0.0] * 4, r["diffs"]
        clipped = [norm > CLIP_NORM for norm in r["norms"]]
        assert any(clipped) and not all(clipped), r["norms"]  # CLIP_NORM lies between the steps' norms
        # a redone step is followed by one after backward (backing off, see step_ahead.py), then ahead again
        assert clipped == [True, False, False, False], r["norms"]
        assert r["modes"] == ["redone", "after_backward", "ahead", "ahead"], (r["modes"], r["norms"])
        report = r["report"]
        assert (report.redone, report.after_backward, report.ahead) == (1, 1, 2)
        assert report.reasons == {"gradients changed after backward": 1, BACKOFF_REASON: 1}
        # rollback copies are kept from the first step on, and reported
        assert all(b > 0 for b in r["rollback"]) and report.rollback_bytes == r["rollback"][-1]


def test_clipping_by_value_steps_after_backward(results):
    for r in results["clip_value"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (0, 0, STEPS), report
        assert report.reasons == {"clipping by value": STEPS} and r["rollback"] == [0] * STEPS


def test_torch_clipping_in_a_hook_redoes_the_steps_it_applies_to(results):
    for r in results["torch_clipping_in_hook"]:
        assert r["diffs"] == [0.0] * 4, r["diffs"]
        report = r["report"]
        # step 0 clips (see the norms of `clip_norm`); torch multiplies by its coefficient even where
        # it is 1, so every step taken ahead is redone, and each redo backs off: 1, then 2 steps after backward
        assert r["modes"] == ["redone", "after_backward", "redone", "after_backward"], r["modes"]
        assert (report.redone, report.after_backward, report.ahead) == (2, 2, 0)
        assert all(b > 0 for b in r["rollback"])  # the overridden hook: copies kept


def test_accumulation_steps_ahead_on_the_last_micro_batch_only(results):
    for r in results["accumulate_4"]:
        assert r["diffs"] == [0.0] * 8, r["diffs"]  # a record per micro-batch
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (2, 0, 0), report
        assert r["modes"] == [None, None, None, "ahead"] * 2


@pytest.mark.parametrize(
    "name", ["assign_gradients", "edit_gradients_in_place"]
)
def test_gradients_edited_in_a_callback_are_stepped_again(results, name):
    for r in results[name]:
        assert r["diffs"] == [0.0] * 4, r["diffs"]
        # edited on steps 1 and 2; step 2 is after backward, backing off from step 1's redo
        assert r["modes"] == ["ahead", "redone", "after_backward", "ahead"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (2, 1, 1)
        assert report.reasons == {"gradients changed after backward": 1, BACKOFF_REASON: 1}
        assert all(b > 0 for b in r["rollback"])  # the callback's hook: copies kept
        assert report.content_checks == report.ahead + report.redone  # and contents compared at each verdict


def test_a_changed_learning_rate_redoes_the_step(results):
    for r in results["learning_rate_changed"]:
        assert r["diffs"] == [0.0] * 4, r["diffs"]
        # later steps read the halved rate ahead (step 2 backs off from step 1's redo)
        assert r["modes"] == ["ahead", "redone", "after_backward", "ahead"]
        assert r["report"].reasons == {"hyperparameters changed after backward": 1, BACKOFF_REASON: 1}


def test_an_lr_scheduler_between_steps_keeps_them_ahead(results):
    for r in results["lr_scheduler"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        assert r["modes"] == ["ahead"] * STEPS and r["report"].reasons == {}


def test_manual_optimization_steps_after_backward(results):
    for r in results["manual_one_optimizer"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (0, 0, STEPS), report
        assert report.reasons == {"manual optimization": STEPS}
        assert r["rollback"] == [0] * STEPS


def test_two_optimizers_never_step_ahead(results):
    # the engine builds no step ahead with more than one optimizer: `host_step_report()` is None
    for r in results["manual_two_optimizers"]:
        assert r["diffs"] == [0.0] * 2, r["diffs"]
        assert r["report"] is None and r["modes"] == [None] * 2 and r["rollback"] == [0] * 2


def test_whole_tensor_optimizer_steps_after_backward(results):
    # whole tensors step on their owner ranks: the engine builds no step ahead
    for r in results["whole_tensor_optimizer"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        assert r["report"] is None


def test_loss_scaling_skips_the_inf_step_everywhere(results):
    ranks = results["loss_scaling_inf_on_one_rank"]
    for r in ranks:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        assert r["moved"] == [False, True]  # batch 1 skipped on every rank
        assert r["scales"] == r["scales_without_overlap"] == [2048.0, 1024.0, 2048.0]
        # each bucket is unscaled as it arrives, so scaled steps are taken during backward; the
        # skipped one is undone on every rank and takes none
        assert r["modes"] == ["ahead", None, "ahead"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (STEPS - 1, 0, 0), report
        assert report.reasons == {"inf or NaN gradients: loss scaling skipped the step": 1} and report.rollback_bytes > 0
    assert ranks[0]["scales"] == ranks[1]["scales"]


def test_sharded_save_and_resume_mid_run(results):
    for r in results["save_and_resume"]:
        assert r["is_directory"]
        assert r["saved"] == [0.0] * 4, r["saved"]
        assert r["resumed"] == [0.0] * 2, r["resumed"]
        assert r["report"].ahead == 2 and r["report"].redone == 0


def test_nvme_offload_steps_during_backward(results):
    for r in results["nvme"]:
        assert r["diffs"] == [0.0] * STEPS, r["diffs"]
        assert r["report"].ahead == STEPS and r["modes"] == ["ahead"] * STEPS


@pytest.mark.parametrize("name", ["slow_backward", "slow_backward_clipped"])
def test_the_host_step_starts_before_backward_ends(results, name):
    for r in results[name]:
        clipped = name == "slow_backward_clipped"
        assert r["diffs"] == [0.0] * (1 if clipped else 2), r["diffs"]
        assert len(r["buckets"]) > 1, r["buckets"]  # the small buckets stepped one by one
        # the last blocks' bucket, reduced first, stepped first, while backward still ran the first block
        assert r["buckets"][0] == 0
        assert r["first_start"] < r["backward_end"], (r["first_start"], r["backward_end"])
        assert r["modes"] == (["redone"] if clipped else ["ahead"] * 2)
        # clipping by norm alone (no hook between backward and the step) keeps rollback copies, and
        # compares no contents (the engine's clipping moves version counters)
        assert all(b > 0 for b in r["rollback"]) if clipped else r["rollback"] == [0, 0]
        assert r["report"].content_checks == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_rolls_back_the_step_loss_scaling_skips(results, stage):
    ranks = results[f"engine_loss_scaling_stage{stage}"]
    for r in ranks:
        assert r["diffs"] == [0.0] * 4, r["diffs"]
        assert r["moved"] == [False, True, True]  # step 1 skipped on every rank
        assert r["scales"] == r["scales_without_overlap"] == [2048.0, 1024.0, 2048.0, 4096.0]
        # without `loss_scale` in the plan, unscaling edits every gradient after backward: a step taken
        # ahead is redone (and the next one backs off); the skipped step's is rolled back before
        # anything reads the chunks again
        assert r["modes"] == ["redone", None, "after_backward", "redone"], r["modes"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (0, 2, 1), report
        assert report.reasons["gradients changed after backward"] == 2 and report.reasons[BACKOFF_REASON] == 1, report.reasons
        assert r["report_without_overlap"] is None
    assert ranks[0]["scales"] == ranks[1]["scales"]

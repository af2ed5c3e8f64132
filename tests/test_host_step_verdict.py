"""The verdict of the host step during backward through the Trainer (issue 59, item 1): a callback edits
the gradients or hyperparameters between backward and the step, one edit form per step, and
``overlap_host_step`` on must give bitwise what off gives, and DDP's weights (within 1e-6), at
zero1/2/3 with ``offload_optimizer`` (and ``offload_params`` at stage 3), in 32-true and bf16-mixed,
with SGD+momentum and AdamW. Every edited step must be redone, for the reason that names what saw it
(``host_step_report().reasons``), so a form that silently commits fails even where the weights agree.

One spawned group of 2 ranks; one fit per configuration covers every form (``EditEachStep``). Backing
off after a redone step is switched off in these runs (``MAX_BACKOFF = 0``), so that each form's step
is taken ahead and judged. The same group runs N5 (a unit backward never reaches, under the Trainer's
plan without rollback copies) and N7 (Fabric with ``16-mixed`` and clipping on every step: backing off
takes effect). ``test_host_step_edits.py`` drives the same edits through the engine in one process.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from host_step_modes import mode_between

from lightning_zero.engine.offload.bucket_step import CONTENTS_CHANGED, GRADIENTS_CHANGED, HYPERPARAMETERS_CHANGED
from lightning_zero.engine.offload.backoff import BACKOFF_REASON

GROUP = CaseGroup(world_size=2)

VARIANTS = {
    "zero1_offload": {"stage": 1, "offload_optimizer": True},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}
PRECISIONS = ("32-true", "bf16-mixed")
OPTIMIZERS = ("sgd_momentum", "adamw")
SMALL_BUCKETS = {"bucket_size_mb": 0.0005}
"""A few parameters per bucket: a backward lands several buckets on the host."""
EXACT = {"fused_host_step": False}
"""The optimizer's own kernel on the host, as DDP runs it: offloaded runs are DDP's bits today."""
DDP_TOLERANCE = 1e-6


# ---- the edit forms ---------------------------------------------------------------------------------


def _params(module: Any) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.grad is not None]


def _shards(optimizer: Any) -> list[torch.Tensor]:
    """What the optimizer steps (what Lightning's precision plugin clips): this rank's chunks under
    lightning-zero, the full parameters under DDP."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _numpy_halve(p: torch.Tensor) -> None:
    view = p.grad.numpy()
    np.multiply(view, 0.5, out=view)


def _scheduler(trainer: Any) -> Any:
    return trainer.lr_scheduler_configs[0].scheduler


Form = Callable[[Any, Any, Any], Any]
FORMS: list[tuple[str, Form, str]] = [
    ("grad_in_place", lambda t, m, o: [p.grad.mul_(0.5) for p in _params(m)], GRADIENTS_CHANGED),
    ("grad_data_clamp", lambda t, m, o: [p.grad.data.clamp_(-1e-3, 1e-3) for p in _params(m)], GRADIENTS_CHANGED),
    ("grad_detach", lambda t, m, o: [p.grad.detach().mul_(0.5) for p in _params(m)], GRADIENTS_CHANGED),
    ("grad_assigned", lambda t, m, o: [setattr(p, "grad", p.grad * 0.5) for p in _params(m)], GRADIENTS_CHANGED),
    ("grad_copy", lambda t, m, o: [p.grad.copy_(p.grad * 0.5) for p in _params(m)], GRADIENTS_CHANGED),
    ("shard_numpy", lambda t, m, o: [_numpy_halve(p) for p in _shards(o)], CONTENTS_CHANGED),
    ("shard_data", lambda t, m, o: [p.grad.data.mul_(0.5) for p in _shards(o)], CONTENTS_CHANGED),
    ("shard_data_assigned", lambda t, m, o: [setattr(p.grad, "data", p.grad * 0.5) for p in _shards(o)], CONTENTS_CHANGED),
    ("shard_set", lambda t, m, o: [p.grad.set_(p.grad * 0.5) for p in _shards(o)], GRADIENTS_CHANGED),
    ("clip_grad_norm_params", lambda t, m, o: torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1e-3), GRADIENTS_CHANGED),
    ("clip_grad_norm_groups", lambda t, m, o: torch.nn.utils.clip_grad_norm_(_shards(o), 1e6), GRADIENTS_CHANGED),
    ("clip_grad_value_params", lambda t, m, o: torch.nn.utils.clip_grad_value_(list(m.parameters()), 1e-3), GRADIENTS_CHANGED),
    ("clip_grad_value_groups", lambda t, m, o: torch.nn.utils.clip_grad_value_(_shards(o), 1e-3), GRADIENTS_CHANGED),
    ("lr_assigned", lambda t, m, o: [g.__setitem__("lr", g["lr"] * 0.5) for g in o.param_groups], HYPERPARAMETERS_CHANGED),
    ("lr_tensor_in_place", lambda t, m, o: [g["lr"].mul_(0.5) for g in o.param_groups], HYPERPARAMETERS_CHANGED),
    ("weight_decay", lambda t, m, o: [g.__setitem__("weight_decay", 0.05) for g in o.param_groups], HYPERPARAMETERS_CHANGED),
    ("scheduler_stepped_between", lambda t, m, o: _scheduler(t).step(), HYPERPARAMETERS_CHANGED),
]
"""(name, edit(trainer, module, optimizer), the reason its redone step must give). The optimizers'
learning rates are tensors (so ``lr_tensor_in_place`` edits one in place), and a scheduler steps
after every step (``StepLR``, which fills them in place): the steps between edits stay ahead."""
STEPS = 1 + len(FORMS) + 1
"""A step without an edit, one per form, and one more."""


def _form_at(step: int) -> Optional[tuple[str, Form, str]]:
    return FORMS[step - 1] if 1 <= step <= len(FORMS) else None


class EditEachStep(Callback):
    """Between backward and the step of step ``i``, applies ``FORMS[i - 1]``, after waiting for the
    host step (so the worker stepped on the unedited gradients and only the verdict can tell). After
    every step records how it was taken and the reasons counted so far."""

    def __init__(self) -> None:
        self.modes: list[Optional[str]] = []
        self.reasons: list[dict] = []
        self.content_checks = 0
        self._report = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        form = _form_at(trainer.global_step)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.wait_for_host_step()
        if form is not None:
            with torch.no_grad():
                form[1](trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        report = engine.host_step_report() if engine is not None else None
        self.modes.append(mode_between(self._report, report))
        self.reasons.append(dict(report.reasons) if report is not None else {})
        self.content_checks = report.content_checks if report is not None else 0
        self._report = report


def _no_backing_off() -> None:
    """Every step is taken ahead (and judged), also right after a redone one."""
    from lightning_zero.engine.offload import backoff

    backoff.MAX_BACKOFF = 0


# ---- the runs ------------------------------------------------------------------------------------------


def _module(optimizer: str) -> Any:
    import lightning as L

    from lightning_helpers import RegressionModule

    class Scheduled(RegressionModule):
        """``RegressionModule`` with tensor learning rates and a ``StepLR`` after every step."""

        def configure_optimizers(self) -> Any:
            if self.optimizer_name == "adamw":
                opt = torch.optim.AdamW(self.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
            else:
                opt = torch.optim.SGD(self.parameters(), lr=torch.tensor(2e-2), momentum=0.9, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    L.seed_everything(0, verbose=False)
    return Scheduled(optimizer=optimizer)


def _fit(strategy: Any, precision: str, optimizer: str) -> dict:
    from lightning_helpers import WeightRecorder, make_trainer, regression_data

    module = _module(optimizer)
    recorder, edits = WeightRecorder(), EditEachStep()
    trainer = make_trainer(strategy, STEPS, callbacks=[recorder, edits], precision=precision)
    trainer.fit(module, regression_data(n=16 * STEPS))
    return {"history": recorder.history, "modes": edits.modes, "reasons": edits.reasons, "content_checks": edits.content_checks}


def _diffs(a: list, b: list) -> Optional[list[float]]:
    from lightning_helpers import max_abs_diff

    return [max_abs_diff(x, y) for x, y in zip(a, b)] if len(a) == len(b) and a else None


def matrix(ctx: RankContext, label: str, precision: str, optimizer: str) -> dict:
    import lightning_zero

    _no_backing_off()
    ddp = ctx.once(("ddp", precision, optimizer), lambda: _fit("ddp", precision, optimizer))
    options = {**VARIANTS[label], **SMALL_BUCKETS, **EXACT}
    strategies = {overlap: lightning_zero.ZeroStrategy(**options, overlap_host_step=overlap) for overlap in (True, False)}
    runs = {overlap: _fit(strategy, precision, optimizer) for overlap, strategy in strategies.items()}
    ahead, after = runs[True], runs[False]
    return {
        "on_off": _diffs(after["history"], ahead["history"]),
        "ddp": _diffs(ddp["history"], ahead["history"]),
        "ddp_without_overlap": _diffs(ddp["history"], after["history"]),
        "modes": ahead["modes"],
        "reasons": ahead["reasons"],
        "content_checks": ahead["content_checks"],
        "modes_without_overlap": after["modes"],
    }


for _label in VARIANTS:
    for _precision in PRECISIONS:
        for _optimizer in OPTIMIZERS:
            GROUP.case(matrix, name=f"{_label}_{_precision}_{_optimizer}", label=_label, precision=_precision, optimizer=_optimizer)


# ---- N5: a unit backward never reaches, the Trainer's plan without rollback copies --------------------


def unused_unit(ctx: RankContext) -> dict:
    """zero3 + ``offload_params``, Block units and an ``aux`` Block registered last, called first, whose
    output is unused; no hook between backward and the step, so the Trainer keeps no rollback copies
    (a verdict that failed would raise)."""
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer, token_data

    import lightning_zero
    from lightning_zero.models.gpt import Block

    class WithAux(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            from lightning_zero.models.gpt import GPT, GPTConfig

            self.model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
            self.aux = Block(self.model.config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            self.aux(torch.zeros(tokens.shape[0], 4, 16))  # output unused: its bucket gets no gradient
            return self.model(tokens[:, :-1], tokens[:, 1:])[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Report(Callback):  # overrides no hook between backward and the step
        report = None

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.report = trainer.strategy.engine.host_step_report()

    def fit(overlap: bool) -> dict:
        L.seed_everything(0, verbose=False)
        options = dict(stage=3, offload_optimizer=True, offload_params=True, unit_classes=["Block"])
        strategy = lightning_zero.ZeroStrategy(**options, overlap_host_step=overlap)
        recorder, seen = WeightRecorder(), Report()
        trainer = make_trainer(strategy, 3, callbacks=[recorder, seen])
        trainer.fit(WithAux(), token_data())
        return {"history": recorder.history, "report": seen.report}

    ahead = fit(True)
    after = fit(False)
    return {"diffs": _diffs(after["history"], ahead["history"]), "report": ahead["report"]}


# ---- N7: Fabric with 16-mixed plans every backward; backing off must take effect ---------------------------


def fabric_backs_off(ctx: RankContext) -> dict:
    """Fabric, ``16-mixed`` on the CPU (a ``MixedPrecision`` plugin with a CPU ``GradScaler``), AdamW,
    ``fabric.clip_gradients`` that applies on every step: every step taken ahead is redone, and the
    steps after each redo are taken after backward (1, then 2)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision
    from lightning_helpers import token_data

    import lightning_zero
    from lightning_zero.engine.offload import backoff
    from lightning_zero.models.gpt import GPT, GPTConfig

    backoff.MAX_BACKOFF = 64  # as shipped (the matrix cases switch it off)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000))
    strategy = lightning_zero.ZeroFabricStrategy(stage=2, offload_optimizer=True, **SMALL_BUCKETS)
    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=strategy, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    engine = fabric.strategy._modules.of(model._forward_module).engine
    modes, previous = [], None
    for i, (tokens,) in enumerate(token_data()):
        if i == 7:
            break
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1e-6)
        optimizer.step()
        optimizer.zero_grad()
        report = engine.host_step_report()
        modes.append(mode_between(previous, report))
        previous = report
    return {"modes": modes, "reasons": dict(previous.reasons)}


GROUP.case(unused_unit, name="unused_unit")
GROUP.case(fabric_backs_off, name="fabric_backs_off")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_step_verdict"))


# ---- the tests --------------------------------------------------------------------------------------------


def _form_reasons(reasons: list[dict]) -> list[dict]:
    """What each step added to the reasons counted."""
    added, before = [], {}
    for now in reasons:
        added.append({k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)})
        before = now
    return added


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_every_edit_form_is_redone_and_bitwise(results, label, precision, optimizer):
    for r in results[f"{label}_{precision}_{optimizer}"]:
        assert r["on_off"] == [0.0] * STEPS, r["on_off"]
        assert r["modes_without_overlap"] == [None] * STEPS  # overlap_host_step=False: no step ahead at all
        # every edited step redone, for the reason that names what saw the edit; the others ahead
        expected = ["ahead"] + ["redone"] * len(FORMS) + ["ahead"]
        added = _form_reasons(r["reasons"])
        seen = zip(FORMS, r["modes"][1:], added[1:])
        wrong = {name: (mode, got) for (name, _, reason), mode, got in seen if (mode, got) != ("redone", {reason: 1})}
        assert not wrong, wrong
        assert r["modes"] == expected, r["modes"]
        assert BACKOFF_REASON not in r["reasons"][-1]
        assert r["content_checks"] == STEPS  # the callback's hooks: user code between backward and the step


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_every_edit_form_gives_ddps_weights(results, label, precision, optimizer):
    for r in results[f"{label}_{precision}_{optimizer}"]:
        assert max(r["ddp"]) <= DDP_TOLERANCE, r["ddp"]


def test_a_unit_backward_never_reaches_redoes_nothing_without_rollback_copies(results):
    for r in results["unused_unit"]:
        assert r["diffs"] == [0.0] * 3, r["diffs"]
        report = r["report"]
        assert (report.ahead, report.redone, report.after_backward) == (3, 0, 0), report
        assert report.reasons == {} and report.rollback_bytes == 0 and report.content_checks == 0


def test_fabric_with_a_loss_scaler_backs_off_after_redone_steps(results):
    for r in results["fabric_backs_off"]:
        # step 0: no scale before its backward; then every step taken ahead clips and is redone,
        # and the steps after each redo are taken after backward: 1, then 2
        assert r["modes"] == ["after_backward", "redone", "after_backward", "redone", "after_backward", "after_backward", "redone"]
        assert r["reasons"][BACKOFF_REASON] == 3, r["reasons"]

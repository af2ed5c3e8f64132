"""ZeRO-3 through ``Trainer(accelerator="cpu", devices=2, strategy="zero3")``: every-step parity
with DDP for the model shapes that break sharding implementations (tied embeddings, frozen layers,
an unused branch, layers built in ``configure_model``), memory held at rest and during forward,
communication per step, evaluation loops, full-parameter access, and errors instead of hangs."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback

STEPS = 4


class _Probe(Callback):
    """Collectives per training step, bytes held at rest, and the most parameter bytes live
    at once during a forward (sampled in every unit's forward)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.bytes: list[dict] = []
        self.live_param_numel_max = 0
        self.at_rest = None
        self.summary = None
        self._handles = []

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.callbacks import ModelSummary

        engine = trainer.strategy.engine
        self.units = [(u.name, u.numel) for u in engine.residency.units]
        for cb in trainer.callbacks:
            if isinstance(cb, ModelSummary):
                s = cb._summary(trainer, pl_module)
                self.summary = (s.total_parameters, s.trainable_parameters, dict(s._get_summary_data()))

        def sample(*_):
            # elements whose storage is allocated (a parameter at rest keeps its shape, not its memory)
            live = sum(p.numel() for p in pl_module.parameters() if p.untyped_storage().nbytes())
            self.live_param_numel_max = max(self.live_param_numel_max, live)

        for unit in engine.residency.units[1:]:
            self._handles.append(unit.module.register_forward_hook(sample))

    def on_train_batch_start(self, *args) -> None:
        from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

        COLLECTIVE_STATS.reset()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

        self.calls.append(dict(COLLECTIVE_STATS.calls))  # forward + backward of this step
        self.bytes.append(dict(COLLECTIVE_STATS.bytes))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        params = list(pl_module.parameters())
        held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        self.at_rest = (trainer.strategy.memory_report(), sum(held.values()), sum(p.numel() for p in params))

    def on_fit_end(self, trainer, pl_module) -> None:
        for h in self._handles:
            h.remove()


class _ReplaceParam(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            pl_module.model.blocks[1].mlp.fc.weight.data = torch.zeros(3, 3)


def _divergent_training_step(self, batch, batch_idx, orders=([0, 0], [0, 1])):
    """Rank 0 runs block 0 twice, rank 1 runs blocks 0 and 1: the ranks gather different units
    (as many on each rank)."""
    import torch.distributed as dist

    x = self.model.wte(batch[0][:, :-1])
    for i in orders[dist.get_rank()]:
        x = self.model.blocks[i](x)
    return x.float().pow(2).mean()


def _swapped_units_training_step(self, batch, batch_idx):
    """Rank 0 runs blocks 0 then 1, rank 1 blocks 1 then 0: the same number of gathers everywhere."""
    return _divergent_training_step(self, batch, batch_idx, orders=([0, 1], [1, 0]))


def _fewer_units_training_step(self, batch, batch_idx):
    """Rank 0 runs block 0, rank 1 blocks 0 and 1: the ranks issue different numbers of gathers."""
    return _divergent_training_step(self, batch, batch_idx, orders=([0], [0, 1]))


GROUP = CaseGroup(world_size=2)
PARITY = {
    # label: (GPTModule arguments, the DDP reference's strategy)
    "tied": ({}, "ddp"),
    "frozen": ({"frozen": True}, "ddp"),
    "unused": ({"unused_branch": True}, "ddp_find_unused_parameters_true"),
    "configure_model": ({"in_configure_model": True}, "ddp"),
    "reused": ({"reused": True}, "ddp"),
}


def parity_with_ddp(ctx: RankContext, label: str) -> dict:
    """DDP and zero3 fitted alike, with validation inside fit; the zero3 run probed."""
    from lightning_helpers import fit_gpt, full_weights, max_abs_diff

    module_kwargs, reference = PARITY[label]
    ref_module, ref_history, ref_trainer = fit_gpt(reference, STEPS, module_kwargs=module_kwargs, limit_val_batches=2, val_check_interval=2)
    probe = _Probe()
    module, history, trainer = fit_gpt("zero3", STEPS, module_kwargs=module_kwargs, callbacks=[probe], limit_val_batches=2, val_check_interval=2, enable_model_summary=True)
    ctx.kept[f"fitted_{label}"] = {"ddp": ref_module, "zero3": module}
    return {
        "diffs": [max_abs_diff(a, b) for a, b in zip(ref_history, history)],
        "val_loss": (ref_trainer.callback_metrics["val_loss"].item(), trainer.callback_metrics["val_loss"].item()),
        # after fit the module stays sharded; summoned, it holds DDP's weights
        "after_fit": max_abs_diff(ref_module.state_dict(), full_weights(module, trainer.strategy)),
        "probe": {
            "calls": probe.calls, "bytes": probe.bytes, "units": probe.units, "live_max": probe.live_param_numel_max,
            "at_rest": probe.at_rest, "summary": probe.summary,
            # true sizes from DDP's module (at rest a stage-3 parameter describes its placeholder)
            "total_numel": sum(p.numel() for p in ref_module.parameters()),
            "trainable_numel": sum(p.numel() for p in ref_module.parameters() if p.requires_grad),
        },
    }


for _label in PARITY:
    GROUP.case(parity_with_ddp, name=f"parity_{_label}", label=_label)


@GROUP.case
def evaluation_after_fit(ctx: RankContext) -> dict:
    """validate/predict after fit (the modules `parity_tied` fitted), with a new Trainer: at stage 3
    it resumes the engine that kept the module sharded after fit."""
    import lightning as L
    from lightning_helpers import token_data

    out = {}
    for name, module in ctx.kept["fitted_tied"].items():
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
        out[("validate", name)] = trainer.validate(module, token_data(8), verbose=False)[0]["val_loss"]
        out[("predict", name)] = torch.cat(trainer.predict(module, token_data(4)))
    return out


@GROUP.case
def summon(ctx: RankContext) -> dict:
    """summon_full_params: read, and write back."""
    import lightning as L
    from lightning_helpers import GPTModule

    L.seed_everything(0, verbose=False)
    return _summon_checks(GPTModule())


def error_message(ctx: RankContext, divergent=None, callbacks: tuple = (), **strategy_options) -> Optional[str]:
    """What fitting a GPT that goes wrong raises (None if nothing does)."""
    import lightning as L
    from lightning_helpers import GPTModule, token_data

    from lightning_zero import ZeroStrategy

    L.seed_everything(0, verbose=False)
    module = GPTModule()
    if divergent is not None:
        module.training_step = divergent.__get__(module)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, **strategy_options), accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=list(callbacks))
    try:
        trainer.fit(module, token_data())
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return None


GROUP.case(error_message, name="error_replaced", callbacks=(_ReplaceParam(),))
GROUP.case(error_message, name="error_divergent", divergent=_divergent_training_step)
# the default on CPU checks after every gather: hang-free also with different numbers of units
GROUP.case(error_message, name="error_fewer_units", divergent=_fewer_units_training_step)
# as on a GPU: tags read once per backward
GROUP.case(error_message, name="error_swapped_read_per_step", divergent=_swapped_units_training_step, check_units_every_gather=False)


def _summon_checks(module) -> dict:
    """Looks inside a running fit from a callback."""
    import lightning as L
    from lightning_helpers import token_data

    results = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if results:
                return
            strategy = trainer.strategy
            w = pl_module.model.blocks[1].mlp.fc.weight
            results["at_rest_numel"] = w.numel()
            results["at_rest_bytes"] = w.untyped_storage().nbytes()
            with strategy.summon_full_params():
                results["inside_shape"] = tuple(w.shape)
                before = w.detach().clone()
                w.data.add_(1.0)
            with strategy.summon_full_params():
                results["read_only_kept"] = torch.equal(w, before)
            with strategy.summon_full_params(writeback=True):
                w.data.add_(1.0)
            with strategy.summon_full_params():
                results["writeback_applied"] = torch.equal(w, before + 1.0)

    L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[Look()]).fit(module, token_data())
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("stage3"))


@pytest.mark.parametrize("label", list(PARITY))
def test_every_step_bitwise_equal_to_ddp(results, label):
    for r in results[f"parity_{label}"]:
        assert r["diffs"] == [0.0] * STEPS
        ref_val, val = r["val_loss"]
        assert ref_val == val
        assert r["after_fit"] == 0.0


def test_evaluation_after_fit_matches_ddp(results):
    for r in results["evaluation_after_fit"]:
        assert r[("validate", "ddp")] == r[("validate", "zero3")]
        assert torch.equal(r[("predict", "ddp")], r[("predict", "zero3")])


@pytest.mark.parametrize("label", ["tied", "frozen"])
def test_model_state_at_rest_is_one_nth(results, label):
    probe = results[f"parity_{label}"][0]["probe"]
    report, held_bytes, visible_param_numel = probe["at_rest"]
    total, trainable = probe["total_numel"], probe["trainable_numel"]
    assert held_bytes == 0  # every parameter's storage is freed between steps
    assert visible_param_numel == total  # with its true size (as DDP counts it)
    n_params = 40  # upper bound on parameter count, for padding
    # fp32 AdamW: params 4 B, grads 4 B, 2 moments 8 B per element, each split over 2 ranks
    assert abs(report.parameters - 4 * total / 2) <= 4 * n_params
    assert report.gradients <= 4 * trainable / 2 + 4 * n_params
    assert abs(report.optimizer_state - 8 * trainable / 2) <= 12 * n_params


def test_live_parameters_bounded_by_units_in_flight(results):
    probe = results["parity_tied"][0]["probe"]
    sizes = dict(probe["units"])
    root, blocks = sizes.pop(""), sorted(sizes.values())
    # root + the computing block + one prefetched block
    assert probe["live_max"] <= root + blocks[-1] + blocks[-2]
    assert probe["live_max"] < probe["total_numel"]


def test_collectives_per_step(results):
    probe = results["parity_tied"][0]["probe"]
    units = len(probe["units"])
    total_bytes = 4 * probe["total_numel"]
    for calls, moved in zip(probe["calls"][1:], probe["bytes"][1:]):  # after the first, prefetching step
        assert calls["all_gather"] <= 2 * units  # root once, every block in forward and backward
        assert calls["reduce_scatter"] == units
        # 3 x model bytes (gathered twice, reduced once) minus the root's second gather, plus padding/tags
        assert 2 * total_bytes <= moved["all_gather"] + moved["reduce_scatter"] <= 3 * total_bytes * 1.02


def test_model_summary_shows_true_sizes(results):
    probe = results["parity_tied"][0]["probe"]
    total, trainable, table = probe["summary"]
    assert total == probe["total_numel"] > 0
    assert trainable == total
    assert "Params per Device" in table


def test_summon_full_params(results):
    for s in results["summon"]:
        assert s["at_rest_numel"] == 64 * 16 and s["at_rest_bytes"] == 0
        assert s["inside_shape"] == (64, 16)
        assert s["read_only_kept"] and s["writeback_applied"]


def test_replaced_parameter_fails_with_a_message(results):
    for message in results["error_replaced"]:
        assert "replaced or resized" in message


def test_ranks_running_different_units_fail_instead_of_hanging(results):
    for message in results["error_divergent"]:
        assert "different ZeRO-3 units" in message


def test_checking_every_gather_fails_when_ranks_run_different_numbers_of_units(results):
    for message in results["error_fewer_units"]:
        assert "different ZeRO-3 units" in message


def test_tags_read_once_per_backward_still_fail_on_every_rank(results):
    for message in results["error_swapped_read_per_step"]:
        assert "different ZeRO-3 units" in message

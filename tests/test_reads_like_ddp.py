"""What DDP code does outside the step gives DDP's answers at every stage (issue 55): ``param.grad``
read after the optimizer step, until ``zero_grad`` (Trainer and Fabric); SWA's static methods called
by class name, as Lightning's own SWA tests do.

One spawned group of 2 CPU ranks; every run is compared with DDP doing the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import RegressionModule, make_trainer, regression_data

VARIANTS = ["zero1", "zero2", "zero3", "zero3_offload"]
STEPS = 3
GROUP = CaseGroup(world_size=2, timeout=300)


def _strategy(name: str) -> Any:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    timeout = timedelta(seconds=60)  # a hang becomes an error
    if name == "ddp":
        return DDPStrategy(timeout=timeout)
    if name == "zero3_offload":  # AdamW's own kernel on the host, as DDP's (see test_grad_views.py)
        return ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, fused_host_step=False, timeout=timeout)
    return ZeroStrategy(stage=int(name[-1]), timeout=timeout)


def _grad_reads(module: torch.nn.Module) -> dict[str, Any]:
    """What logging code reads from every parameter's ``.grad``: whole-tensor reductions (collectives)
    and element-wise results reduced."""
    out: dict[str, Any] = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        out[name] = (
            g.detach().sum().item(),
            (g * 2 + 1).abs().max().item(),
            torch.where(g > 0, g, 0.0).sum().item(),
            bool(torch.isfinite(g).all()),
        )
    return out


class GradsAfterTheStep(RegressionModule):
    """Reads ``.grad`` after each optimizer step (``on_train_batch_end``, as Lightning's own
    ``test_ddp_gradients_synced``) and again after the next ``zero_grad`` (``on_before_backward``)."""

    def __init__(self, set_to_none: bool = True) -> None:
        super().__init__(optimizer="adamw")
        self.set_to_none = set_to_none
        self.after_step: list[dict[str, Any]] = []
        self.after_zero_grad: list[dict[str, Any]] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.after_step.append(_grad_reads(self))
        self.after_step[-1]["bias_sum"] = self.model.out.bias.grad.detach().sum().item()

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.after_zero_grad.append(_grad_reads(self))


def grads_after_the_step(ctx: RankContext, set_to_none: bool) -> dict[str, Any]:
    import lightning as L

    results = {}
    for variant in ["ddp", *VARIANTS]:
        L.seed_everything(0, verbose=False)
        module = GradsAfterTheStep(set_to_none)
        make_trainer(_strategy(variant), STEPS).fit(module, regression_data(64))
        results[variant] = {"after_step": module.after_step, "after_zero_grad": module.after_zero_grad}
    return results


GROUP.case(name="grads_after_the_step", fn=grads_after_the_step, set_to_none=True)
GROUP.case(name="grads_after_the_step_zeroed", fn=grads_after_the_step, set_to_none=False)


@GROUP.case
def fabric_grads_after_the_step(ctx: RankContext) -> dict[str, Any]:
    from fabric_loop import batches_for, fabric_for, small_gpt

    results = {}
    for variant in ["ddp", "zero1", "zero2", "zero3"]:
        fabric = fabric_for(variant)
        fabric.seed_everything(0)
        module = small_gpt()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        seen = []
        for step, batch in enumerate(batches_for(ctx.rank, 2)):
            fabric.backward(model(batch[:, :-1], batch[:, 1:])[1])
            optimizer.step()
            after_step = _grad_reads(module)  # the user's module: DDP's wrapper renames the parameters
            optimizer.zero_grad(set_to_none=step == 0)
            seen.append({"after_step": after_step, "after_zero_grad": _grad_reads(module)})
        results[variant] = seen
    return results


def _swa_by_class_name(ctx: RankContext, variant: str) -> dict[str, Any]:
    """SWA whose subclass calls Lightning's static methods by class name, as Lightning's own
    ``test_stochastic_weight_avg.py`` does: the average reached, the weights after ``fit``."""
    import lightning as L
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning_helpers import full_weights

    class CountingSWA(StochasticWeightAveraging):
        update_calls = transfer_calls = 0

        def update_parameters(self, *args: Any, **kwargs: Any) -> None:
            self.update_calls += 1
            return StochasticWeightAveraging.update_parameters(*args, **kwargs)

        def transfer_weights(self, *args: Any, **kwargs: Any) -> None:
            self.transfer_calls += 1
            return StochasticWeightAveraging.transfer_weights(*args, **kwargs)

    L.seed_everything(0, verbose=False)
    module = RegressionModule(optimizer="sgd_momentum")
    swa = CountingSWA(swa_lrs=1e-2, swa_epoch_start=2, annealing_epochs=1)
    trainer = make_trainer(_strategy(variant), -1, callbacks=[swa], max_epochs=3, limit_train_batches=3)
    trainer.fit(module, regression_data(64))
    return {"weights": full_weights(module, trainer.strategy), "calls": (swa.update_calls, swa.transfer_calls)}


@GROUP.case
def swa_by_class_name(ctx: RankContext) -> dict[str, Any]:
    return {variant: _swa_by_class_name(ctx, variant) for variant in ["ddp", "zero1", "zero2", "zero3"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("reads_like_ddp"))


def _assert_like_ddp(ours: Any, ddp: Any, where: str) -> None:
    assert ours.keys() == ddp.keys(), where
    for name, value in ddp.items():
        if value is None or isinstance(value, bool):
            assert ours[name] == value, f"{where}: {name}"
        else:
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{where}: {name}"


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_grad_after_the_step_reads_as_under_ddp_until_zero_grad(results: GroupResults, variant: str, set_to_none: bool) -> None:
    case = "grads_after_the_step" if set_to_none else "grads_after_the_step_zeroed"
    for rank, runs in enumerate(results[case]):
        ddp, ours = runs["ddp"], runs[variant]
        assert len(ours["after_step"]) == len(ddp["after_step"]) == STEPS
        assert all(v is not None for v in ddp["after_step"][0].values())  # DDP keeps them: the test reads something
        for when in ("after_step", "after_zero_grad"):
            for step, (a, b) in enumerate(zip(ours[when], ddp[when])):
                _assert_like_ddp(a, b, f"rank {rank} {when} {step}")
        if set_to_none:
            assert all(v is None for v in ddp["after_zero_grad"][1].values())
        else:
            assert ddp["after_zero_grad"][1]["model.out.weight"][0] == 0.0  # zeros, not None


@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero3"])
def test_fabric_grad_after_the_step_reads_as_under_ddp_until_zero_grad(results: GroupResults, variant: str) -> None:
    for rank, runs in enumerate(results["fabric_grads_after_the_step"]):
        for step, (ours, ddp) in enumerate(zip(runs[variant], runs["ddp"])):
            for when in ("after_step", "after_zero_grad"):
                _assert_like_ddp(ours[when], ddp[when], f"rank {rank} step {step} {when}")
        assert all(v is None for v in runs["ddp"][0]["after_zero_grad"].values())
        assert all(v is not None for v in runs["ddp"][1]["after_zero_grad"].values())


@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero3"])
def test_swa_static_methods_called_by_class_name_average_as_under_ddp(results: GroupResults, variant: str) -> None:
    for rank, runs in enumerate(results["swa_by_class_name"]):
        ddp, ours = runs["ddp"], runs[variant]
        assert ours["calls"] == ddp["calls"] and ddp["calls"][0] == 2 and ddp["calls"][1] == 1, ddp["calls"]
        for key, value in ddp["weights"].items():
            assert torch.allclose(ours["weights"][key], value, rtol=1e-6, atol=1e-7), f"rank {rank}: {key}"

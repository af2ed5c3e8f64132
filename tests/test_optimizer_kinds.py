"""Which optimizers step flat chunks and which whole tensors on owner ranks, how owners are chosen,
and the refusals (one process, no ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.optimizer.optimizer_kinds import StepGranularity, check_steppable, step_granularity
from lightning_zero.engine.optimizer.tensor_owners import plan_owners


class MyAdamW(torch.optim.AdamW):
    """A user's subclass of a known element-wise optimizer."""


class Normalized(torch.optim.SGD):
    """A subclass of SGD whose `step` might not be element-wise: its known base decides (see the test)."""

    def step(self, closure=None):
        return super().step(closure)


class Unknown(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


def _params():
    return [nn.Parameter(torch.zeros(3, 2))]


def test_known_element_wise_take_chunks():
    assert step_granularity(torch.optim.AdamW(_params())) is StepGranularity.CHUNKS
    assert step_granularity(MyAdamW(_params())) is StepGranularity.CHUNKS
    schedulefree = pytest.importorskip("schedulefree")
    assert step_granularity(schedulefree.AdamWScheduleFree(_params())) is StepGranularity.CHUNKS


def test_known_whole_tensor_take_owners_without_a_hint():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if hasattr(torch.optim, "Muon"):  # torch >= 2.9
            assert step_granularity(torch.optim.Muon(_params())) is StepGranularity.WHOLE_TENSORS
        assert step_granularity(torch.optim.Adafactor(_params())) is StepGranularity.WHOLE_TENSORS
        pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
        assert step_granularity(pytorch_optimizer.Lamb(_params())) is StepGranularity.WHOLE_TENSORS
        assert step_granularity(pytorch_optimizer.SOAP(_params())) is StepGranularity.WHOLE_TENSORS


def test_unknown_takes_owners_with_one_hint_and_can_be_declared():
    with pytest.warns(UserWarning, match=r"elementwise_optimizers=\[.*Unknown'\]"):
        assert step_granularity(Unknown(_params())) is StepGranularity.WHOLE_TENSORS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        assert step_granularity(Unknown(_params())) is StepGranularity.WHOLE_TENSORS
        assert step_granularity(Unknown(_params()), ["Unknown"]) is StepGranularity.CHUNKS
        assert step_granularity(Unknown(_params()), [f"{__name__}.Unknown"]) is StepGranularity.CHUNKS
    # a subclass of SGD that is not element-wise must be declared the other way: its base is known
    assert step_granularity(Normalized(_params(), lr=0.1)) is StepGranularity.CHUNKS


@pytest.mark.parametrize("cls,why", [(torch.optim.LBFGS, "re-evaluates the loss"), (torch.optim.SparseAdam, "sparse gradients")])
def test_unsteppable_refused(cls, why):
    with pytest.raises(ValueError, match=why):
        check_steppable(cls(_params()))


def test_elementwise_optimizers_option_is_checked():
    assert ZeroConfig(elementwise_optimizers=["MyAdam"]).elementwise_optimizers == ("MyAdam",)
    with pytest.raises(TypeError, match="elementwise_optimizers"):
        ZeroConfig(elementwise_optimizers="MyAdam")


def test_owners_balanced_by_size():
    numels = [100, 60, 50, 10, 5, 1]
    plan = plan_owners(numels, 2)
    assert plan.owners == (0, 1, 1, 0, 0, 1)  # largest first, each to the least loaded rank (ties: lower)
    assert plan.elements_per_rank(numels) == [115, 111]
    assert plan_owners(numels, 4).elements_per_rank(numels) == [100, 60, 50, 16]
    assert plan_owners([3], 2).owned_by(1) == []


class EvaluatesTwice(torch.optim.Adafactor):
    """A line search of sorts: the closure once more before stepping (a subclass calling super().step())."""

    def step(self, closure=None):
        closure()
        return super().step(closure)


def test_closure_evaluated_twice_is_refused():
    model = nn.Linear(3, 2)
    once, twice = torch.optim.Adafactor([model.weight]), EvaluatesTwice([model.bias])
    engine = ZeroEngine(model, [once, twice], ZeroConfig(stage=2))

    def closure():
        engine.begin_step()
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        engine.finish_backward()
        engine.end_step()
        return loss

    assert once.step(closure) is not None  # evaluated once: fine
    engine.after_optimizer_step(once)
    with pytest.raises(RuntimeError, match="evaluated its closure a second time"):
        twice.step(closure)
    engine.close()


def test_nvme_offload_refuses_whole_tensor_optimizers(tmp_path):
    model = nn.Linear(3, 2)
    config = ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="steps whole tensors"):
        ZeroEngine(model, [torch.optim.Adafactor(model.parameters())], config)


def test_a_bound_schedule_free_optimizer_pickles_and_copies_as_its_own_class():
    import copy
    import pickle

    schedulefree = pytest.importorskip("schedulefree")
    model = nn.Linear(3, 2)
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.5)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2))
    assert isinstance(opt, schedulefree.AdamWScheduleFree) and type(opt) is not schedulefree.AdamWScheduleFree  # train/eval wrapped
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert type(clone) is schedulefree.AdamWScheduleFree and clone.param_groups[0]["lr"] == 0.5
    engine.close()
    assert type(opt) is schedulefree.AdamWScheduleFree

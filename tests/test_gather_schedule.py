"""Stage 3's gather schedule in one process (world size 1 takes the same gather/free path)."""

from __future__ import annotations

import copy
from typing import Iterator

import torch
from torch import nn


class CalledTwiceInARow(nn.Module):
    """``blocks[0]`` runs twice back to back: one call's output is the next call's input, so the
    two calls' backward hooks fire on the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](self.blocks[0](x))).pow(2).mean()


def _losses(model: nn.Module, x: torch.Tensor) -> Iterator[torch.Tensor]:
    """One loss per backward of the step, each computed after the previous one's backward (a
    model's ``losses`` method where it has several)."""
    return model.losses(x) if hasattr(model, "losses") else iter([model(x)])


def _assert_stage3_matches_torch(reference: nn.Module, steps: int = 3) -> None:
    """Stage 3 at world size 1 trains ``reference``'s copy to the same weights, bitwise, running
    each step's losses as separate backward passes, as manual optimization does."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3))
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for loss in _losses(reference, x):
            loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.begin_step()
        for loss in _losses(model, x):
            loss.backward()
            engine.finish_backward()
        engine.end_step()
        opt.step()
        engine.after_optimizer_step(opt)
        opt.zero_grad()
    engine.release_parameters(torch.device("cpu"))
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_a_module_called_twice_in_a_row_stays_gathered_for_both_backwards():
    torch.manual_seed(0)
    _assert_stage3_matches_torch(CalledTwiceInARow())  # freed mid-backward, this raised a storage error


class TwoBackwardsPerStep(nn.Module):
    """Two losses, each with its own forward and backward in one step (a GAN's generator and
    critic losses under manual optimization); ``blocks[0]``'s input never needs a gradient, so
    its parameters' accumulation is what ends its backward, in both passes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 1)])

    def losses(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield self.blocks[1](self.blocks[0](x)).mean()
        yield self.blocks[1](self.blocks[0](x)).pow(2).mean()


def test_each_backward_of_a_step_keeps_units_gathered_until_their_gradients_accumulate():
    torch.manual_seed(0)
    _assert_stage3_matches_torch(TwoBackwardsPerStep())  # the 2nd backward freed blocks[0] after its bias


def test_a_parameter_at_rest_reads_and_writes_as_ddps_and_refuses_what_a_chunk_cannot_take():
    """Outside its unit's forward and backward (see [Note: parameters at rest], [Note: reads at
    rest], [Note: writes at rest]): what describes the parameter works, what reads its values gets
    DDP's values (gathered for that read), what writes into it — directly or through a value read
    from it — writes what the same write does to a plain module; what would change the parameter
    rather than its values fails naming it; gathered, it is a plain parameter."""
    import pickle

    import pytest

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = CalledTwiceInARow()
    before = copy.deepcopy(model)
    reference = copy.deepcopy(model)  # what DDP's replica holds after the same writes
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
    weight, expected = model.blocks[1].weight, before.blocks[1].weight.detach()
    # its true size at rest (as DDP's, and FSDP2's DTensors)
    assert weight.numel() == 64 and weight.shape == (8, 8) and weight.requires_grad and weight.dtype == torch.float32 and weight.grad is None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in CalledTwiceInARow().parameters())
    reads = {
        "clone": lambda: weight.clone(),
        "detach": lambda: weight.detach(),
        "data": lambda: weight.data,
        "view": lambda: weight.view(-1).view(8, 8),
        "cpu": lambda: weight.cpu(),
        "numpy": lambda: torch.from_numpy(weight.detach().numpy().copy()),
        "tolist": lambda: torch.tensor(weight.tolist()),
        "state_dict": lambda: model.state_dict()["blocks.1.weight"],
        "deepcopy": lambda: copy.deepcopy(model).blocks[1].weight,
        "pickle": lambda: pickle.loads(pickle.dumps(weight)),
    }
    for what, read in reads.items():
        value = read()
        assert torch.equal(value, expected), what
    assert torch.equal(weight, expected) and weight.sum() == expected.sum()
    assert type(pickle.loads(pickle.dumps(weight))) is nn.Parameter and type(weight.clone()) is torch.Tensor
    full = torch.arange(64.0).view(8, 8)
    writes = {  # each applied to the parameter at rest and to the reference's: the same values after each
        "copy_": lambda w: w.copy_(full),
        "add_": lambda w: w.add_(1),
        "setitem": lambda w: w.__setitem__(0, 1.0),
        "augmented": lambda w: w.__imul__(0.5),
        "reads itself": lambda w: w.add_(w.flip(0)),
        "out": lambda w: torch.add(full, full, out=w),
        "init zeros_": lambda w: nn.init.zeros_(w),
        "init constant_ (by keyword)": lambda w: nn.init.constant_(w, 0.25),
        "init xavier": lambda w: (torch.manual_seed(5), nn.init.xavier_uniform_(w)),
        "through detach": lambda w: w.detach().mul_(2),
        "through data": lambda w: w.data.copy_(full.t()),
        "through a transposed alias": lambda w: w.data.t().sub_(1),
        "through view": lambda w: w.view(-1)[0:2].fill_(3.0),
        "clamp through data": lambda w: w.data.clamp_(-5.0, 5.0),
    }
    for what, write in writes.items():
        with torch.no_grad():
            result = write(weight)
            write(reference.blocks[1].weight)
        assert torch.equal(weight, reference.blocks[1].weight), what
        if what in ("copy_", "add_", "out"):
            assert result is weight, what  # in place, as torch returns it
    held = weight.data  # a value read earlier, written later: the write reaches today's values
    with torch.no_grad():
        weight.add_(1)
        held.mul_(2)
        reference.blocks[1].weight.add_(1)
        reference.blocks[1].weight.data.mul_(2)
    assert torch.equal(weight, reference.blocks[1].weight) and torch.equal(held, reference.blocks[1].weight)
    model.load_state_dict(before.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    refused = {  # what a chunk cannot take, and what torch refuses for a parameter that requires a gradient
        "resize_": (lambda: weight.resize_(4), "storage, shape"),
        "t_": (lambda: weight.t_(), "storage, shape"),
        "detach_": (lambda: _without_grad(weight.detach_), "storage, shape"),
        "grad mode": (lambda: weight.copy_(full), "torch.no_grad()"),
        "grad mode, a view": (lambda: weight.view(-1).zero_(), "torch.no_grad()"),
    }
    for what, (write, says) in refused.items():
        with pytest.raises(RuntimeError, match=r"parameter 'blocks\.1\.weight'") as err:
            write()
        assert says in str(err.value), what
    assert torch.equal(weight, expected)  # nothing refused changed anything
    with pytest.raises(RuntimeError, match=r"'blocks\.[01]\.(weight|bias)' was replaced or resized"):
        model.to(torch.float64)  # reads, then assigns `.data` a new dtype: refused
    from lightning_zero.engine.shards.at_rest import is_at_rest

    assert is_at_rest(weight)
    with engine.gathered():
        assert not is_at_rest(weight) and weight.clone().shape == (8, 8) and type(weight.clone()) is torch.Tensor
        assert type(copy.deepcopy(weight)) is nn.Parameter  # copies are plain, never of the unit's class
        assert torch.equal(weight, expected)
    assert is_at_rest(weight)
    assert model(torch.randn(2, 8)).isfinite()  # a unit's forward sees its full parameters
    engine.close()
    assert type(weight) is nn.Parameter  # the engine gone, a plain parameter again


def _without_grad(write):
    with torch.no_grad():
        return write()


def test_data_assigned_at_rest_is_adopted_and_a_new_shape_or_dtype_fails_naming_both():
    """``param.data = value`` between steps (pretrained weights loaded into a built model): each
    rank keeps its chunk of ``value`` and the parameter stays at rest, as at stages 1-2."""
    import pytest

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = CalledTwiceInARow()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
    weight, value = model.blocks[1].weight, torch.randn(8, 8)
    weight.data = value
    from lightning_zero.engine.shards.at_rest import is_at_rest

    assert is_at_rest(weight)  # still at rest
    with engine.gathered():
        assert torch.equal(weight, value)
    for wrong, named in ((torch.zeros(3, 3), r"\(3, 3\) \(torch.float32\)"), (value.double(), r"\(8, 8\) \(torch.float64\)")):
        with pytest.raises(RuntimeError, match=rf"'blocks\.1\.weight' was replaced or resized.* {named}, the parameter has shape \(8, 8\) \(torch.float32\)"):
            weight.data = wrong
    with engine.gathered():
        assert torch.equal(weight, value)  # a refused tensor changed nothing
    engine.close()

"""``torch.save(pl_module)`` and ``copy.deepcopy(pl_module)`` in a callback inside ``fit`` give what
DDP's give, at every stage: a module with the full weights that loads with ``torch.load`` where
lightning-zero is not imported (its pickle names nothing of it), a copy that is a plain module (no
engine hooks: see [Note: engine entries are not copied] in ``engine/parameters/module_hooks.py``), and the fit
goes on as DDP's.

One spawned group of 2 CPU ranks; every run is compared with DDP doing the same.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import named_strategy

VARIANTS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
STEPS = 4
SAVED_AFTER_STEP = 2
GROUP = CaseGroup(world_size=2, timeout=300)


def _plainness(module: torch.nn.Module) -> dict[str, Any]:
    """What tells a plain module from one an engine still holds."""
    from lightning_zero.engine.engine import linked_engine

    return {
        "forward_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules()),
        "instance_getstate": any("__getstate__" in vars(m) for m in module.modules()),
        "param_types": sorted({type(p).__name__ for p in module.parameters()}),
        "engine": linked_engine(module) is not None,
        "trainer": module._trainer is not None,
    }


def _saved_in_fit(ctx: RankContext, variant: str) -> dict[str, Any]:
    import copy

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning_helpers import WeightRecorder, make_trainer, regression_data
    from plain_modules import SequentialRegression

    path = os.path.join(ctx.tmpdir, f"{variant}_{ctx.rank}.pt")
    seen: dict[str, Any] = {}
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))

    class SavesTheModule(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step != SAVED_AFTER_STEP:
                return
            torch.save(pl_module, path)  # on every rank: at stage 3 each parameter is read (a collective)
            copied = copy.deepcopy(pl_module)
            seen["copy"] = {k: v.detach().clone() for k, v in copied.state_dict().items()}
            seen["copy_output"] = copied(x).detach()  # the copy computes alone, with its own weights
            seen["copy_plain"] = _plainness(copied)
            seen["original_hooks"] = sum(len(m._forward_pre_hooks) for m in pl_module.modules())

    L.seed_everything(0, verbose=False)
    module = SequentialRegression()
    recorder = WeightRecorder()
    make_trainer(named_strategy(variant), STEPS, callbacks=[SavesTheModule(), recorder]).fit(module, regression_data(64))
    return {**seen, "path": path, "history": recorder.history}


@GROUP.case
def saved_in_fit(ctx: RankContext) -> dict[str, Any]:
    return {variant: _saved_in_fit(ctx, variant) for variant in ["ddp", *VARIANTS]}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("saving_in_fit"))


def _pickle_of(path: str) -> bytes:
    """The pickle inside ``torch.save``'s zip file (its tensors' bytes are beside it)."""
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The entries of ``a`` and ``b`` that differ, with their largest difference (for the failure's message)."""
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_module_saved_and_copied_inside_fit_is_ddps(results: GroupResults, variant: str) -> None:
    for rank, runs in enumerate(results["saved_in_fit"]):
        ddp, ours = runs["ddp"], runs[variant]
        # the file: DDP's weights at that step, bitwise, loaded in this process; a plain module
        assert b"lightning_zero" not in _pickle_of(ours["path"]), f"rank {rank}: the pickle names lightning-zero"
        loaded, expected = torch.load(ours["path"], weights_only=False), torch.load(ddp["path"], weights_only=False)
        assert _equal(loaded.state_dict(), expected.state_dict()), f"rank {rank}: {_differences(loaded.state_dict(), expected.state_dict())}"
        assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in loaded.modules()) == 0
        assert {type(p) for p in loaded.parameters()} == {torch.nn.Parameter}
        assert not any("__getstate__" in vars(m) for m in loaded.modules())
        # the copy: DDP's copy's weights and outputs, and a plain module as DDP's is
        assert _equal(ours["copy"], ddp["copy"]) and _equal(ours["copy"], expected.state_dict()), f"rank {rank}"
        assert torch.equal(ours["copy_output"], ddp["copy_output"]), f"rank {rank}"
        assert ours["copy_plain"] == ddp["copy_plain"] == {
            "forward_hooks": 0, "instance_getstate": False, "param_types": ["Parameter"], "engine": False, "trainer": False,
        }  # fmt: skip
        if variant.startswith("zero3"):
            assert ours["original_hooks"] > 0  # the engine's own hooks were there, and stayed
        # training went on as DDP's, every step
        assert len(ours["history"]) == len(ddp["history"]) == STEPS
        for step, (a, b) in enumerate(zip(ours["history"], ddp["history"])):
            assert _equal(a, b), f"rank {rank}, step {step}"

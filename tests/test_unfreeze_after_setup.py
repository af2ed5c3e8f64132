"""A parameter frozen when the engine set the module up and unfrozen later: the engine made no
gradient bucket or optimizer chunk for it, so it would silently not train. Each step refuses it,
naming it, at every stage; a model where nothing is unfrozen runs as before
(``engine/parameters/frozen_guard.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def _steps(stage: int, unfreeze_at: int | None, steps: int = 3) -> list[torch.Tensor]:
    model = _model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"unit_classes": ["Linear"]} if stage == 3 else {}
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, **extra), device=torch.device("cpu"))
    torch.manual_seed(1)
    try:
        for step in range(steps):
            if step == unfreeze_at:
                model[0].requires_grad_(True)  # what BackboneFinetuning does at its epoch
            engine.begin_step()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
        with engine.gathered():
            return [p.detach().clone() for p in model.parameters()]
    finally:
        engine.close()


def _plain(steps: int = 3) -> list[torch.Tensor]:
    model = _model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_unfrozen_after_setup_is_refused_naming_it(stage: int) -> None:
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) frozen .* require gradients now: '0.weight', '0.bias'.*BackboneFinetuning"):
        _steps(stage, unfreeze_at=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_left_frozen_train_as_before(stage: int) -> None:
    assert all(torch.equal(a, b) for a, b in zip(_steps(stage, unfreeze_at=None), _plain()))


def test_lightnings_backbone_finetuning_is_refused_at_setup() -> None:
    """Lightning's own callback, which unfreezes the backbone at an epoch: a clear error before the
    first step (it would fail with a bare KeyError at that epoch: its param-group mapping looks up the
    module's parameters, the optimizer holds chunks)."""
    import lightning as L
    from lightning.pytorch.callbacks import BackboneFinetuning
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero

    class WithBackbone(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.head(self.backbone(batch[0])).pow(2).mean()

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(stage=2), accelerator="cpu", devices=1, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match="BackboneFinetuning unfreezes parameters during `fit`.*one `fit` per phase"):
            trainer.fit(WithBackbone(), DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4))
    finally:  # the Trainer made this process's default group before the refusal: the next test file makes its own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

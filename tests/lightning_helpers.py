"""A LightningModule over the test models, and a Trainer factory for 2 CPU ranks."""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from models import OddShapes


class RegressionModule(L.LightningModule):
    def __init__(self, make_model: Callable[[], nn.Module] = OddShapes, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model = make_model()
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        name = self.optimizer_name
        if name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if name == "sgd_momentum":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        if name == "two_groups_steplr":
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}], lr=1e-2
            )
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"}}
        if name == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if name == "not_an_optimizer":
            return {"optimizer": object()}
        if name == "foreign_tensor":
            return torch.optim.SGD([*self.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        raise ValueError(name)


def regression_data(n: int = 64, batch_size: int = 4) -> DataLoader:
    """The same global dataset on every rank; Lightning's DistributedSampler splits it."""
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)), batch_size=batch_size)


class WeightRecorder(Callback):
    """Weights after every optimizer step."""

    def __init__(self) -> None:
        self.history: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.history.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def make_trainer(strategy: Any, max_steps: int, callbacks: Optional[list] = None, **kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


def fit_and_record(
    strategy: Any,
    max_steps: int = 4,
    seed: int = 0,
    module_kwargs: Optional[dict] = None,
    data_size: int = 64,
    ckpt_path: Optional[str] = None,
    **trainer_kwargs: Any,
):
    """Fit a freshly seeded RegressionModule; returns (module, weights after each step, trainer)."""
    L.seed_everything(seed, verbose=False)
    module = RegressionModule(**(module_kwargs or {}))
    recorder = WeightRecorder()
    trainer = make_trainer(strategy, max_steps, callbacks=[recorder, *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs)
    trainer.fit(module, regression_data(data_size), ckpt_path=ckpt_path)
    return module, recorder.history, trainer


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

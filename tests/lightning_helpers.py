"""A LightningModule over the test models, and a Trainer factory for 2 CPU ranks."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import lightning as L
import lightning.pytorch.callbacks
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401 - registers the strategy names ("zero1", ...) the tests pass as strings
from models import OddShapes
from multiprocess import ranks_started

HAS_WEIGHT_AVERAGING = hasattr(lightning.pytorch.callbacks, "EMAWeightAveraging")
"""Lightning's ``WeightAveraging`` / ``EMAWeightAveraging`` callbacks, which arrived in Lightning 2.6.0
(``StochasticWeightAveraging`` is older). Register a case that uses them only where they exist: a
case failing on its import would stop the cases after it."""
needs_weight_averaging = pytest.mark.skipif(
    not HAS_WEIGHT_AVERAGING, reason="Lightning's EMAWeightAveraging / WeightAveraging callbacks (Lightning 2.6.0 and newer)"
)


class RegressionModule(L.LightningModule):
    def __init__(self, make_model: Callable[[], nn.Module] = OddShapes, optimizer: str = "adamw", inf_at_batch: int = -1) -> None:
        super().__init__()
        self.model = make_model()
        self.optimizer_name = optimizer
        self.inf_at_batch = inf_at_batch  # scale the loss by inf there: non-finite gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        return loss * float("inf") if batch_idx == self.inf_at_batch else loss

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
        if name == "adafactor_groups":  # a whole-tensor optimizer, factored on the matrices, two param groups
            matrices = [p for p in self.parameters() if p.ndim == 2]
            rest = [p for p in self.parameters() if p.ndim != 2]
            return torch.optim.Adafactor([{"params": matrices}, {"params": rest, "lr": 3e-2, "weight_decay": 0.01}], lr=1e-2)
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
    """Full weights after every optimizer step (gathered under stage 3)."""

    def __init__(self) -> None:
        self.history: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        summon = getattr(trainer.strategy, "summon_full_params", contextlib.nullcontext)
        with summon():
            self.history.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def full_weights(module: L.LightningModule, strategy: Any = None) -> dict[str, torch.Tensor]:
    """A copy of ``module.state_dict()`` with full tensors. After ``fit`` a stage-3 module stays
    sharded at rest, so it is gathered with ``strategy.summon_full_params()`` (on every rank)."""
    summon = getattr(strategy, "summon_full_params", contextlib.nullcontext)
    with summon():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def named_strategy(name: str) -> Any:
    """DDP (``"ddp"``) or ours by variant name (``"zero1"`` ... ``"zero3"``, ``"zero2_offload"``,
    ``"zero3_offload"``: stage 3 offloads its parameters too), with a 60 s timeout, so that a hang
    becomes an error. Offload keeps AdamW's own kernel on the host (the default), as DDP's."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    timeout = timedelta(seconds=60)
    if name == "ddp":
        return DDPStrategy(timeout=timeout)
    stage = int(name[len("zero")])
    if name.endswith("_offload"):
        return ZeroStrategy(stage=stage, offload_optimizer=True, offload_params=stage == 3, timeout=timeout)
    return ZeroStrategy(stage=stage, timeout=timeout)


def make_trainer(strategy: Any, max_steps: int, callbacks: Optional[list] = None, **kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=ranks_started(),
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


class GPTModule(L.LightningModule):
    """The reference GPT (tied embedding / LM head, blocks in a ModuleList) as a LightningModule.

    ``frozen``: freeze the position embedding and the first block (fine-tuning the rest).
    ``unused_branch``: a block that is never called. ``in_configure_model``: build the layers in
    ``configure_model`` from layers that initialise in ``reset_parameters()`` (a plain MLP stack
    with a tied embedding), so a meta-device build can reproduce an eager one.
    """

    def __init__(
        self,
        frozen: bool = False,
        unused_branch: bool = False,
        in_configure_model: bool = False,
        reused: bool = False,
        fused_adamw: bool = False,
    ) -> None:
        super().__init__()
        self.frozen, self.unused_branch, self.in_configure_model = frozen, unused_branch, in_configure_model
        self.reused = reused
        self.fused_adamw = fused_adamw  # the optimizer's own `fused=True` kernel
        self.model: Optional[nn.Module] = None
        if not in_configure_model:
            self._build()

    def _build(self) -> None:
        from lightning_zero.models.gpt import GPT, GPTConfig

        if self.in_configure_model:
            self.model = TiedMLPStack()
        else:
            self.model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16))
            if self.unused_branch:
                self.model.spare = nn.ModuleList([nn.Linear(16, 16)])
            if self.frozen:
                self.model.wpe.requires_grad_(False)
                self.model.blocks[0].requires_grad_(False)
            if self.reused:
                # block 0 runs twice per forward (first and last), a buffer scales the logits and
                # the training step reads a weight directly, outside any submodule's forward
                blocks = self.model.blocks
                self.model.blocks = nn.ModuleList([blocks[0], blocks[1], blocks[2], blocks[0]])
                self.register_buffer("logit_scale", torch.tensor(0.5))

    def configure_model(self) -> None:
        if self.model is None:
            self._build()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        if not self.reused:
            return self.model(idx, targets)
        logits = self.model(idx)[0] * self.logit_scale
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch[0][:, :-1], batch[0][:, 1:])[1]
        if self.reused:
            loss = loss + 1e-2 * self.model.wte.weight.pow(2).mean()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch[0][:, :-1], batch[0][:, 1:])[1]
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0][:, :-1])[0]

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1, fused=self.fused_adamw or None)


class TiedMLPStack(nn.Module):
    """Embedding → blocks of Linear+LayerNorm → head tied to the embedding; initialised only by the
    layers' own ``reset_parameters()``."""

    def __init__(self, vocab: int = 256, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def token_data(n: int = 32, length: int = 17, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(11)
    return DataLoader(TensorDataset(torch.randint(0, 256, (n, length), generator=g)), batch_size=batch_size)


def fit_gpt(
    strategy: Any,
    max_steps: int = 4,
    module_kwargs: Optional[dict] = None,
    callbacks: Optional[list] = None,
    ckpt_path: Optional[str] = None,
    **trainer_kwargs: Any,
):
    """Fit a freshly seeded GPTModule; returns (module, weights after each step, trainer)."""
    L.seed_everything(0, verbose=False)
    module = GPTModule(**(module_kwargs or {}))
    recorder = WeightRecorder()
    trainer = make_trainer(strategy, max_steps, callbacks=[recorder, *(callbacks or [])], **trainer_kwargs)
    trainer.fit(module, token_data(), token_data(8), ckpt_path=ckpt_path)
    return module, recorder.history, trainer


class TwoOptimizerModule(L.LightningModule):
    """Manual optimization with two optimizers over disjoint parameter sets, GAN-style: a
    "generator" step then a "critic" step per batch, each toggling its optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3))
        self.critic = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_c = self.optimizers()
        self.toggle_optimizer(opt_g)
        fake = self.generator(x)
        loss_g = nn.functional.mse_loss(fake, y) - self.critic(fake).mean()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_c)
        loss_c = self.critic(self.generator(x).detach()).mean() - self.critic(y).mean()
        self.manual_backward(loss_c)
        opt_c.step()
        opt_c.zero_grad()
        self.untoggle_optimizer(opt_c)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.AdamW(self.generator.parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.SGD(self.critic.parameters(), lr=1e-2, momentum=0.9),
        )

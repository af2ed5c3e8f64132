"""Train a small byte-level GPT on the Python standard library's source, with any lightning-zero strategy.

    python examples/train_gpt.py fit                                  # DDP on 2 CPU processes
    python examples/train_gpt.py fit --trainer.strategy=zero2
    python examples/train_gpt.py fit --model.n_layer=8 --data.block_size=256 --trainer.accelerator=gpu
    python examples/train_gpt.py validate --ckpt_path=PATH
    python examples/train_gpt.py fit --print_config > gpt.yaml     # then: fit --config gpt.yaml
    python examples/train_gpt.py fit --config configs/big_models/meta_init.yaml   # and the other big-model configs

For models that do not fit one device, four options each take one line (configs/big_models/ has a
config for each, and they combine): `model.meta_init` (build on the meta device, materialized one
block at a time under zero3), `model.activation_checkpointing` (recompute each block's activations in
backward), `model.compile` (torch.compile), and the strategy `zero3_offload` (CPU offload).

The defaults (a 1.8M-parameter model, 400 steps) are sized for a 2-core CPU: in about 2.5 minutes
validation loss falls from 5.3 nats per byte untrained (ln 256 = 5.55 is a uniform guess) to about 1.85.

Everything lands in the logger's directory (`lightning_logs/version_N/` by default): the metrics (train and
validation loss, perplexity and, under a ZeRO strategy, each rank's model-state memory beside
`lightning-zero estimate`'s prediction, from `ZeroMemoryMonitor`) and the checkpoints Lightning's default
`ModelCheckpoint` saves after each validation (`checkpoints/`, resumable with `--ckpt_path`).
"""

import math
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

# stdlib_corpus.py sits next to this file; make it importable however the script is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser  # noqa: E402
from torch import nn  # noqa: E402
from torchmetrics import MeanMetric  # noqa: E402
from torchmetrics.text import Perplexity  # noqa: E402

import lightning_zero  # noqa: E402,F401  registers the strategy names zero1, zero2, zero3, ...
from lightning_zero import ZeroCLI, ZeroMemoryMonitor  # noqa: E402
from lightning_zero.models.gpt import GPT, Block, GPTConfig  # noqa: E402
from stdlib_corpus import StdlibCorpus  # noqa: E402


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning-rate multiplier at `step`: linear warm-up (Adam's moment estimates are noisy for the
    first steps), then a cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(L.LightningModule):
    """A GPT trained for next-byte prediction; logs train loss, validation loss and perplexity."""

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 192,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.99),
        cosine_schedule: bool = True,
        warmup_steps: int = 30,
        min_lr_ratio: float = 0.1,
        meta_init: bool = False,
        activation_checkpointing: bool = False,
        compile: bool = False,
        compile_backend: Optional[str] = None,
    ) -> None:
        """
        Args:
            block_size: context length; linked to `data.block_size`, so set that one.
            n_layer: transformer blocks (each one unit under stage 3).
            n_head: attention heads; must divide n_embd.
            n_embd: width of the residual stream. 4 blocks of 192 give 1.8M parameters, about the most
                a 2-core CPU trains visibly in a few minutes.
            dropout: see `GPTConfig.dropout`.
            bias: biases in Linear layers and LayerNorms.
            lr: peak AdamW learning rate. 3e-3 suits a model this small and short a run (nanoGPT's
                character-level 10M model uses 1e-3 for 5,000 steps).
            weight_decay: decoupled weight decay for matrices and embeddings; biases and LayerNorm
                weights are not decayed (pulling a gain toward 0 is not regularisation).
            betas: AdamW's moment decay rates; 0.99 rather than 0.999 lets the second moment follow
                the fast-changing gradients of a short run.
            cosine_schedule: warm up then decay the learning rate; False keeps it constant at `lr`.
            warmup_steps: linear warm-up length, in optimizer steps.
            min_lr_ratio: the cosine schedule's final learning rate, as a fraction of `lr`.
            meta_init: build the GPT in `configure_model` rather than here, each layer initialising
                itself in `reset_parameters()`. Under zero3 that runs on the meta device (no memory),
                and the strategy allocates, initialises and shards one block at a time: no rank holds
                the whole model during setup. Under other strategies the same model is built eagerly, with
                the same weights. GPT-2's init either way, but drawn in another order than the
                default build's, so a different (seeded) start.
            activation_checkpointing: run every block's forward under torch's non-reentrant
                activation checkpointing: backward recomputes a block's activations instead of keeping
                them from forward, which saves activation memory for one more forward per block and
                step. Parameter names, and so checkpoints, do not change.
            compile: `torch.compile` each block's forward, where the compute is. ZeRO-3's gather and
                free hooks run around a block's forward, outside its graph, and the identical blocks
                share one graph. Parameter names, and so checkpoints, do not change.
            compile_backend: torch.compile's backend; None picks "inductor" where CUDA is available
                and "aot_eager" elsewhere: inductor also runs on CPU, given a C++ compiler, but on 2
                cores it compiled for 6 s and gained nothing at this size.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[nn.Module] = None
        self.no_decay: frozenset = frozenset()
        if not meta_init:
            self._build_model()
        # Token-weighted mean of the loss (the last batch may be short), synchronised across ranks.
        self.val_loss = MeanMetric()
        self.val_perplexity = Perplexity()
        self.test_loss = MeanMetric()
        self.test_perplexity = Perplexity()

    def configure_model(self) -> None:
        # Lightning calls this before each fit/validate/test: build once
        if self.model is None:
            self._build_model()

    def _build_model(self) -> None:
        hp = self.hparams
        shape = dict(block_size=hp.block_size, n_layer=hp.n_layer, n_head=hp.n_head, n_embd=hp.n_embd)
        self.model = GPT(GPTConfig(**shape, dropout=hp.dropout, bias=hp.bias, init_per_layer=hp.meta_init))
        if hp.compile:
            backend = hp.compile_backend or ("inductor" if torch.cuda.is_available() else "aot_eager")
            compile_every_block(self.model, backend)
        if hp.activation_checkpointing:  # around the compiled forward: backward recomputes it compiled
            checkpoint_every_block(self.model)
        # Decided now, while every parameter has its real shape (meta tensors have theirs): a sharding
        # strategy may flatten them before configure_optimizers runs. Vectors (biases, LayerNorm
        # weights) are not decayed.
        self.no_decay = frozenset(name for name, p in self.model.named_parameters() if p.ndim < 2)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # (B, T), (B, T)
        _, loss = self.model(inputs, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_perplexity)

    def test_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_perplexity)

    def _evaluate(
        self, batch: Tuple[torch.Tensor, torch.Tensor], split: str, loss: MeanMetric, perplexity: Perplexity
    ) -> None:
        inputs, targets = batch  # (B, T), (B, T)
        logits, batch_loss = self.model(inputs, targets)  # (B, T, V), ()
        loss.update(batch_loss, weight=targets.numel())
        perplexity.update(logits.float(), targets)
        # Logging the metric objects lets Lightning compute them once per epoch, over all ranks.
        self.log(f"{split}_loss", loss, prog_bar=True)
        self.log(f"{split}_perplexity", perplexity)

    def configure_optimizers(self) -> Dict[str, Any]:
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if name in self.no_decay else decay).append(param)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        if not hp.cosine_schedule:
            return {"optimizer": optimizer}
        schedule = partial(
            warmup_cosine,
            warmup_steps=hp.warmup_steps,
            total_steps=self.trainer.estimated_stepping_batches,
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def checkpoint_every_block(model: nn.Module) -> None:
    """Run each `Block`'s forward under torch's non-reentrant activation checkpointing: what torch's
    `checkpoint_wrapper` does, without the wrapper module, whose `_checkpoint_wrapped_module.` would
    enter the parameter names and so the sharded checkpoints' keys (a checkpoint saved with it would
    not load without it, nor the other way round). The block's hooks (stage 3's gather and free) run
    around the checkpointed forward, as they run around a wrapper."""
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)


def compile_every_block(model: nn.Module, backend: str) -> None:
    """`torch.compile` the forward of each `Block` in place: the identical blocks share one graph, and
    the modules stay as they are, so parameter names (and checkpoint keys) do not change, where
    `torch.compile(model)` would prefix every key with `_orig_mod.`. (Compiling the whole model works
    too: stage 3's gather hooks run eagerly, see `tests/test_compile.py`.)"""
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = torch.compile(module.forward, backend=backend)


class GPTCLI(ZeroCLI):
    """LightningCLI with the one argument model and data must agree on set once, and a memory monitor; as
    ZeroCLI, a strategy option it refuses is one line saying what it accepts."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        # Always on, and configurable like the model: `--memory_monitor.every_n_steps=50`, `--memory_monitor.unit=KB`
        # or a `memory_monitor:` section in YAML. Under DDP it warns once that it has nothing to measure.
        parser.add_lightning_class_args(ZeroMemoryMonitor, "memory_monitor")


def main() -> None:
    GPTCLI(
        GPTLightningModule,
        StdlibCorpus,
        seed_everything_default=1234,  # the same model and data on every rank, and on every run
        trainer_defaults={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_steps": 400,
            # Every 50 steps (~20 s here); limit_val_batches keeps each pass to ~2 s: 20 batches x
            # 16 windows x 2 ranks = 640 of the validation split's ~1,560 windows, the same ones each time.
            "val_check_interval": 50,
            "limit_val_batches": 20,
            "log_every_n_steps": 10,
            "gradient_clip_val": 1.0,  # GPT-2's; keeps the early high-lr steps stable
        },
    )


if __name__ == "__main__":
    main()

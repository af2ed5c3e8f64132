"""Train a Hugging Face `transformers` causal language model with LightningCLI and any lightning-zero strategy.

    python examples/hf_causal_lm.py fit --config configs/hf_zero3.yaml                  # GPT-2 shape, zero3, 2 CPU processes
    python examples/hf_causal_lm.py fit --config configs/hf_zero3.yaml --trainer.strategy=ddp
    python examples/hf_causal_lm.py fit --config configs/hf_zero3.yaml --model.model_name=gpt2 --data.tokenizer=gpt2
    python examples/hf_causal_lm.py fit --config configs/hf_zero3.yaml --save_pretrained=my_model

The model is any `AutoModelForCausalLM`: built with random weights from `model.config` (a
`transformers` config as data: `model_type` and its fields, see configs/hf_zero3.yaml), or, when
`model.model_name` is given, loaded with `from_pretrained` (a Hub name or a local directory; every rank
loads it on its host, then the strategy shards it). The data is the Python standard library's source
(`stdlib_corpus.py`, no download), one token per byte (vocabulary 256) or tokenized by `data.tokenizer`,
which a pretrained model needs: its own. A directory this example exported holds no tokenizer: it
trains on bytes again.

After `fit`, the full weights are written with `save_pretrained` (default: `hf_model/` in the logger's
directory), so that `AutoModelForCausalLM.from_pretrained(directory)` loads the trained model with no
lightning-zero and no process group. Under ZeRO-3 no rank holds the full model at rest; for the export
`summon_full_params(rank0_only=True, offload_to_cpu=True)` gathers it one block at a time into rank 0's
host memory, the other ranks keeping their shards.
"""

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

# stdlib_corpus.py sits next to this file; make it importable however the script is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402
from transformers import get_cosine_schedule_with_warmup  # noqa: E402

import lightning_zero  # noqa: E402,F401  registers the strategy names zero1, zero2, zero3, ...
from lightning_zero import ZeroCLI, ZeroStrategy  # noqa: E402
from stdlib_corpus import StdlibCorpus  # noqa: E402


class CausalLM(L.LightningModule):
    """A `transformers` causal LM trained for next-token prediction; logs train and validation loss."""

    def __init__(
        self,
        model_name: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 30,
    ) -> None:
        """
        Args:
            model_name: a Hugging Face Hub name or a directory written by `save_pretrained`: its
                pretrained weights (give `data.tokenizer` its tokenizer). None: build from `config`.
            config: `AutoConfig.for_model(**config)`: `model_type` (gpt2, llama, ...) and the fields of
                that model's config; ignored when `model_name` is given.
            lr: peak AdamW learning rate.
            weight_decay: for matrices and embeddings; vectors (biases, norm weights) are not decayed.
            betas: AdamW's moment decay rates.
            warmup_steps: linear warm-up, then a cosine decay to 0 at the last step (transformers'
                `get_cosine_schedule_with_warmup`).
        """
        super().__init__()
        self.save_hyperparameters()
        if model_name is not None:
            self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_name)
            self.model.train()  # from_pretrained returns it in eval mode (no dropout), and Lightning keeps modes
        elif config is not None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        else:
            raise ValueError("Give model.model_name (pretrained weights) or model.config (random weights).")
        # Decided now, while every parameter has its real shape: at stage 3 the strategy shards them
        # before configure_optimizers runs.
        self.no_decay = frozenset(name for name, p in self.model.named_parameters() if p.ndim < 2)

    def _loss(self, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch  # (B, T), (B, T): targets are the inputs shifted by one token
        logits = self.model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

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
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = get_cosine_schedule_with_warmup(optimizer, min(hp.warmup_steps, total_steps), total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StdlibTokens(StdlibCorpus):
    """`StdlibCorpus` (the standard library's source), one token per byte or, with `tokenizer`, tokenized by
    that Hugging Face tokenizer."""

    def __init__(
        self,
        tokenizer: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.1,
        seed: int = 1234,
    ) -> None:
        """
        Args:
            tokenizer: a Hub name or directory for `AutoTokenizer.from_pretrained`, the pretrained model's
                (`model.model_name`); None: bytes (vocabulary 256).
            block_size: tokens per training sequence.
            batch_size: sequences per batch on each rank.
            max_bytes: corpus size, in bytes of source.
            val_fraction: share of the corpus, from its end, held out for validation.
            seed: seeds the training windows' offsets (the same on every rank).
        """
        super().__init__(block_size, batch_size, max_bytes, val_fraction, seed)
        self.tokenizer = tokenizer

    def setup(self, stage: str) -> None:
        if self.train_data is not None:
            return
        super().setup(stage)  # the bytes
        if self.tokenizer is not None:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
            def encode(data: torch.Tensor) -> torch.Tensor:  # (L,) uint8 bytes -> (L',) int64 tokens
                return torch.tensor(tokenizer(bytes(data.tolist()).decode(errors="replace"))["input_ids"])

            self.train_data, self.val_data = encode(self.train_data), encode(self.val_data)


def save_pretrained(model: PreTrainedModel, trainer: L.Trainer, directory: str) -> None:
    """`model.save_pretrained(directory)` with the full weights, written by rank 0; call it on every rank."""
    strategy = trainer.strategy
    # ZeRO-3 holds a shard of each parameter at rest; stages 1-2 and DDP the full ones
    if isinstance(strategy, ZeroStrategy):
        full_weights = strategy.summon_full_params(rank0_only=True, offload_to_cpu=True)
    else:
        full_weights = nullcontext()
    with full_weights:
        if trainer.is_global_zero:
            model.save_pretrained(directory)
    strategy.barrier()


class CausalLMCLI(ZeroCLI):
    """LightningCLI that exports the model with `save_pretrained` after `fit` (as ZeroCLI: a strategy option it
    refuses is one line saying what it accepts)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--save_pretrained", type=Optional[str], default=None,
            help="Where fit writes the trained model with save_pretrained (default: hf_model/ in the logger's directory).",
        )  # fmt: skip

    def after_fit(self) -> None:
        directory = self.config[self.subcommand].save_pretrained or str(Path(self.trainer.log_dir) / "hf_model")
        save_pretrained(self.model.model, self.trainer, directory)
        if self.trainer.is_global_zero:
            print(f"Saved the trained model to {directory}: AutoModelForCausalLM.from_pretrained({directory!r})")


def main(args: Optional[list] = None) -> CausalLMCLI:
    return CausalLMCLI(
        CausalLM,
        StdlibTokens,
        args=args,
        seed_everything_default=1234,  # the same initial weights and data on every rank
        trainer_defaults={"accelerator": "cpu", "devices": 2, "strategy": "zero3"},
    )


if __name__ == "__main__":
    main()

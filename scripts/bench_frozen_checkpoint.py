"""Checkpoints of a LoRA fine-tune with and without the frozen base (``save_frozen``): bytes written
and save time, measured.

    python scripts/bench_frozen_checkpoint.py [--devices 2] [--layers 8] [--width 512] [--stages 2 3]

A transformers Llama (built from a config, no download) with PEFT LoRA adapters (r=8 on q_proj and
v_proj) is fitted for one step on ``--devices`` CPU ranks at each stage, then saved three times with
``save_frozen=True`` and three times with ``save_frozen=False`` (the first save of a run also creates
the DCP process group, so the median is printed). Also printed: how long the fingerprint of the
frozen weights alone takes (``checkpoint/frozen.py``), each rank checksumming the elements it holds:
the first time in a run, and again (each rank keeps its parts while the weights do not move, so a
later save's fingerprint is a lookup).
Runs in a minute or two on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import lightning as L
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_zero  # noqa: F401 - registers the strategy names
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.frozen import fingerprint, frozen_names
from lightning_zero.checkpoint.group import CheckpointGroup

VOCAB = 8192


class _LoraLlama(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the base, as `from_pretrained` would give it: the same on every rank
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=width, intermediate_size=int(width * 8 / 3) // 64 * 64, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4,
        )  # fmt: skip
        self.model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class _FingerprintTime(L.Callback):
    """At the end of the fit, with the engine still there: the fingerprint's time (every rank)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy, group = trainer.strategy, CheckpointGroup()
        fingerprint(pl_module, strategy.engine, group, [])  # its gloo group made first, as a save's is
        strategy.barrier()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fingerprint(pl_module, strategy.engine, group, frozen_names(pl_module))
            times.append(time.perf_counter() - start)
        self.seconds, self.again_seconds = times


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()

    out = os.environ.setdefault("BENCH_FROZEN_DIR", tempfile.mkdtemp(prefix="bench_frozen_"))
    tokens = torch.randint(0, VOCAB, (4 * args.devices, 64), generator=torch.Generator().manual_seed(0))
    rows = []
    for stage in args.stages:
        for save_frozen in (True, False):
            L.seed_everything(0, verbose=False)
            module = _LoraLlama(args.layers, args.width)
            total = sum(p.numel() for p in module.parameters())
            trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
            timer = _FingerprintTime()
            trainer = L.Trainer(
                strategy=ZeroStrategy(stage=stage, save_frozen=save_frozen), accelerator="cpu", devices=args.devices,
                max_steps=1, logger=False, callbacks=[timer], enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
            seconds = []
            for attempt in range(3):
                path = os.path.join(out, f"zero{stage}-{save_frozen}-{attempt}")
                trainer.strategy.barrier()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                seconds.append(time.perf_counter() - start)
            rows.append((stage, save_frozen, statistics.median(seconds), _size(path) / 1e6, timer.seconds, timer.again_seconds))
    if trainer.is_global_zero:
        print(f"Llama + LoRA: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable; {args.devices} CPU ranks, AdamW")
        print(f"{'stage':>5} {'save_frozen':>11} {'save s (median of 3)':>21} {'written MB':>11} {'fingerprint s (first, again)':>29}")
        for stage, save_frozen, seconds, mb, fp_first, fp_again in rows:
            fp = f"{fp_first:14.3f} {fp_again:14.4f}" if not save_frozen else f"{'':29}"
            print(f"{stage:>5} {str(save_frozen):>11} {seconds:21.3f} {mb:11.2f} {fp}")
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

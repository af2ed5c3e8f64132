"""Sharded directory or one full file: what a checkpoint costs, measured (the numbers behind
``ZeroStrategy``'s default ``state_dict_type``).

    python scripts/checkpoint_formats.py [--devices 2] [--layers 8] [--width 512] [--out DIR]

Fits a GPT for one step at stage 3 on ``--devices`` CPU ranks, then saves it in each format twice
(the first save also creates the DCP process group) and prints, per format: the save time, how much
each rank's peak resident memory rose during the save (Linux: ``/proc/self/clear_refs`` resets the
peak), and the bytes written. Runs in a few minutes on 2 cores; on GPUs pass ``--accelerator cuda``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401 - registers the strategy names
from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPT, GPTConfig


class _GPTModule(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=8192, block_size=64, n_layer=layers, n_head=8, n_embd=width))

    def training_step(self, batch, batch_idx):
        return self.model(batch[0][:, :-1], batch[0][:, 1:])[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    out = args.out or os.environ.setdefault("CHECKPOINT_FORMATS_DIR", tempfile.mkdtemp(prefix="ckpt_formats_"))
    tokens = torch.randint(0, 8192, (8 * args.devices, 65), generator=torch.Generator().manual_seed(0))
    rows = []
    for state_dict_type in ("sharded", "full"):
        L.seed_everything(0, verbose=False)
        module = _GPTModule(args.layers, args.width)
        numel = sum(p.numel() for p in module.parameters())  # before fit: at stage 3 it stays sharded after
        strategy = ZeroStrategy(stage=3, state_dict_type=state_dict_type)
        trainer = L.Trainer(
            strategy=strategy, accelerator=args.accelerator, devices=args.devices, max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
        for attempt in range(2):
            path = os.path.join(out, f"{state_dict_type}-{attempt}.ckpt")
            trainer.strategy.barrier()
            _peak_rss_reset()
            before = _rss_kib("VmRSS")
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            seconds = time.perf_counter() - start
            rise = torch.tensor([(_rss_kib("VmHWM") - before) / 1024.0])
            rises = trainer.strategy.all_gather(rise).flatten().tolist()
            if trainer.is_global_zero:
                rows.append((state_dict_type, attempt, seconds, rises, _size(path) / 1e6))
    if trainer.is_global_zero:
        print(f"GPT with {numel / 1e6:.1f}M parameters, stage 3, {args.devices} ranks, AdamW state included")
        print(f"{'format':8} {'save':>4} {'seconds':>8} {'peak RSS rise per rank (MB)':>30} {'written (MB)':>13}")
        for state_dict_type, attempt, seconds, rises, mb in rows:
            per_rank = ", ".join(f"{r:.0f}" for r in rises)
            print(f"{state_dict_type:8} {attempt + 1:>4} {seconds:8.2f} {per_rank:>30} {mb:13.1f}")
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

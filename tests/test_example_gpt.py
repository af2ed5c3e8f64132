"""The GPT example end to end (a short `fit` in two processes) and its data module's determinism."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# Small enough that the run is dominated by process start-up (~10 s on 2 cores), big enough that every
# part runs: 2 blocks (two stage-3 units besides the root), the tied head, a validation pass mid-training.
TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=100000",
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=2",
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
]


@pytest.mark.parametrize("strategy", ["ddp"])
def test_train_gpt_fit(tmp_path, strategy):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        str(EXAMPLES / "train_gpt.py"),
        "fit",
        *TINY,
        f"--trainer.strategy={strategy}",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"

    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as metrics:
        val_losses = [float(row["val_loss"]) for row in csv.DictReader(metrics) if row["val_loss"]]
    assert val_losses, "validation never ran"
    # An untrained byte-level model predicts about uniformly: ln(256) = 5.55 nats per byte.
    assert all(4.0 < loss < 6.5 for loss in val_losses), val_losses


def test_stdlib_corpus_is_deterministic_and_byte_level(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from stdlib_corpus import StdlibCorpus, read_corpus

    first, second = (StdlibCorpus(block_size=32, batch_size=4, max_bytes=50_000, val_fraction=0.1) for _ in range(2))
    for datamodule in (first, second):
        datamodule.setup("fit")

    corpus = read_corpus(50_000)
    assert corpus.dtype == torch.uint8 and len(corpus) == 50_000
    assert torch.equal(torch.cat([first.train_data, first.val_data]), corpus)
    assert len(first.val_data) == 5_000  # the last 10%
    assert torch.equal(first.train_data, second.train_data) and torch.equal(first.val_data, second.val_data)
    assert b"def " in bytes(first.train_data.tolist())  # it is Python source

    for loader in ("train_dataloader", "val_dataloader"):
        a, b = getattr(first, loader)().dataset, getattr(second, loader)().dataset
        assert torch.equal(a.offsets, b.offsets), f"{loader}: windows differ between two builds"
        inputs, targets = a[len(a) - 1]
        assert inputs.shape == targets.shape == (32,) and inputs.dtype == torch.int64
        assert torch.equal(inputs[1:], targets[:-1])  # targets are the inputs shifted by one byte
        assert 0 <= int(inputs.min()) and int(inputs.max()) < 256

    # A different seed draws different training windows, over the same split.
    other = StdlibCorpus(block_size=32, batch_size=4, max_bytes=50_000, seed=7)
    other.setup("fit")
    assert not torch.equal(other.train_dataloader().dataset.offsets, first.train_dataloader().dataset.offsets)

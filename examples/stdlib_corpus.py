"""Byte-level language-modelling data that needs no download: the Python standard library's own source.

Every machine that runs the examples has a Python, and its standard library is a few megabytes of
real, varied code. The corpus is its `.py` files in sorted path order, cut at `max_bytes`, one token
per byte (vocabulary 256). The first part trains, the last `val_fraction` validates; because files
are in path order, validation is mostly modules the model never trained on.

The bytes depend on the Python version (3.11's stdlib is not 3.12's), so losses compare across runs
on one machine, not across machines.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Installed third-party packages live under the stdlib directory too; they are not the stdlib and
differ between machines."""


def stdlib_source_files(root: Optional[Path] = None) -> Iterator[Path]:
    """The standard library's `.py` files under `root` (default: this Python's stdlib), in a fixed order:
    a depth-first walk with directories and files sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)  # in place: prunes and orders the walk
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(directory, name)


def read_corpus(max_bytes: int, root: Optional[Path] = None) -> Tensor:
    """The first `max_bytes` bytes of the concatenated source files, as a (L,) uint8 tensor of tokens."""
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in stdlib_source_files(root):
        chunk = path.read_bytes()[:remaining]
        chunks.append(chunk)
        remaining -= len(chunk)
        if remaining == 0:
            break
    # bytearray: frombuffer needs a writable buffer to share memory without a warning.
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class Windows(Dataset):
    """Windows of `block_size + 1` tokens starting at `offsets`; item i is (input, target), each (T,) int64,
    the target being the input shifted left by one token."""

    def __init__(self, data: Tensor, offsets: Tensor, block_size: int) -> None:
        self.data = data  # (L,) uint8
        self.offsets = offsets  # (num_windows,) int64
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index])
        window = self.data[start : start + self.block_size + 1].long()  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


def random_offsets(length: int, block_size: int, seed: int) -> Tensor:
    """One random window start per `block_size` tokens of the split (an epoch sees about as many tokens
    as the split holds), drawn from a generator of its own seeded with `seed`: every rank draws the same
    offsets, and the sampler, not the dataset, decides which rank reads which."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, length - block_size, (length // block_size,), generator=generator)


def strided_offsets(length: int, block_size: int) -> Tensor:
    """Back-to-back windows covering the split once, so validation is the same every time."""
    return torch.arange(0, length - block_size, block_size)


class StdlibCorpus(L.LightningDataModule):
    """Next-byte prediction over the standard library's source. The `test` stage evaluates on the
    validation split: the corpus is small, and a third split would leave too little to learn from."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.1,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            block_size: tokens per training sequence (the model's context length).
            batch_size: sequences per batch on each rank.
            max_bytes: corpus size. 2 MB (the first ~75 top-level modules of CPython 3.11's stdlib)
                reads in ~10 ms and holds more training bytes than the default CPU run consumes.
            val_fraction: share of the corpus, taken from its end, held out for validation.
            seed: seeds the training windows' offsets (the same on every rank).
            num_workers: DataLoader worker processes; 0 loads in the training process, which is
                fastest here since a batch is a few slices of a tensor already in memory.
        """
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be positive, got {block_size} and {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_data: Optional[Tensor] = None  # (L_train,) uint8
        self.val_data: Optional[Tensor] = None  # (L_val,) uint8

    def setup(self, stage: str) -> None:
        """Read and split the corpus on every rank (it is small, and nothing is downloaded, so there is
        nothing for `prepare_data` to do once)."""
        if self.train_data is not None:  # setup runs once per stage: fit, then validate or test
            return
        data = read_corpus(self.max_bytes)
        split = int(len(data) * (1.0 - self.val_fraction))
        train_data, val_data = data[:split], data[split:]
        if min(len(train_data), len(val_data)) <= self.block_size:
            raise ValueError(
                f"max_bytes={self.max_bytes} gives {len(train_data)} training and {len(val_data)} validation "
                f"bytes, too few for block_size={self.block_size}; raise max_bytes or val_fraction"
            )
        self.train_data, self.val_data = train_data, val_data

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,  # equal batches on every rank and step
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_data is not None, "setup('fit') reads the corpus"
        offsets = random_offsets(len(self.train_data), self.block_size, self.seed)
        return self._loader(Windows(self.train_data, offsets, self.block_size), train=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_data is not None, "setup reads the corpus"
        offsets = strided_offsets(len(self.val_data), self.block_size)
        return self._loader(Windows(self.val_data, offsets, self.block_size), train=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

"""Pretrain a LitGPT model with LitGPT's own pretraining script, sharded by lightning-zero (ZeRO-3 in Fabric).

    python examples/litgpt_pretrain.py --config configs/litgpt_pretrain.yaml                  # zero3, 2 CPU processes
    python examples/litgpt_pretrain.py --config configs/litgpt_pretrain.yaml --strategy zero2
    python examples/litgpt_pretrain.py --config configs/litgpt_pretrain.yaml --resume true    # from the latest step-*/
    python examples/litgpt_pretrain.py --config configs/litgpt_pretrain.yaml --devices 8 --precision bf16-mixed

Which script this is: LitGPT's `litgpt/pretrain.py` itself. Its `main()` builds the model under
`fabric.init_module(empty_init=True)` (at stage 3 on the meta device; setup then materializes one block
at a time with LitGPT's GPT-NeoX init, so no rank holds the whole model), `torch.compile`s it, sets
up the model, the optimizer and the dataloaders, and resumes with `fabric.load`; its `fit()` runs the
warm-up + cosine learning rate, gradient accumulation under `fabric.no_backward_sync`,
`fabric.clip_gradients`, validation, and `fabric.save` every `train.save_interval` optimizer steps.
Both run unchanged. This file replaces LitGPT's `setup()` only, whose one job is to make the Fabric
and which hard-codes `FSDPStrategy` for more than one device: here the strategy is `--strategy`
(default `zero3`, any name in Fabric's registry). The rest of `setup()` is repeated as it is, less
printing and logging the arguments (LitGPT writes them beside each checkpoint, in
hyperparameters.yaml). The command line and YAML format are `litgpt pretrain`'s (parsed against its
`setup()`), plus `--strategy`, which a YAML file cannot hold: LitGPT parses the command line again
for hyperparameters.yaml.

The data, `StdlibBytes` below, is a LitGPT data module over the Python standard library's source, one
token per byte (so `model_config.vocab_size: 256` and no tokenizer): nothing to download. Its training
loader resumes mid-epoch, as LitGPT's default one (litdata's `StreamingDataLoader`) does: Fabric saves
its `state_dict()` in the checkpoint, which holds `train_dataloader`, so a resumed run sees the batches
an uninterrupted one would have.

Checkpoints: `OUT_DIR/step-N/lit_model.pth` and `OUT_DIR/final/lit_model.pth` are *directories* under a
ZeRO strategy (each rank writes its own chunks, see the README's Checkpoints); `--resume` reads them
at any world size and stage. LitGPT's other tools (`litgpt generate`, `convert_from_litgpt`) read one
file of weights; write it with (the weights are under the Trainer's key there, `state_dict`)

    full = torch.load(lightning_zero.checkpoint_file("OUT_DIR/final/lit_model.pth"))
    torch.save(full["state_dict"], "OUT_DIR/final/lit_model_full.pth")
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

# stdlib_corpus.py sits next to this file; make it importable however the script is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from jsonargparse import ActionConfigFile, ArgumentParser  # noqa: E402
from litgpt import Tokenizer, pretrain  # noqa: E402
from litgpt.config import Config  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from litgpt.utils import (  # noqa: E402
    check_nvlink_connectivity,
    choose_logger,
    extend_checkpoint_dir,
    get_default_supported_precision,
    init_out_dir,
    parse_devices,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

import lightning_zero  # noqa: E402,F401  registers zero1, zero2, zero3, ... in Fabric's strategy registry
from stdlib_corpus import read_corpus  # noqa: E402


# ---- data ----------------------------------------------------------------------------------------
class TokenBlocks(Dataset):
    """Back-to-back blocks of `length` tokens, each (length,) int64: the input and, shifted by one, the
    target of a sequence of `length - 1` tokens, as LitGPT's pretraining loop slices them."""

    def __init__(self, tokens: torch.Tensor, length: int) -> None:
        self.tokens = tokens  # (L,) uint8
        self.length = length

    def __len__(self) -> int:
        return len(self.tokens) // self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index * self.length : (index + 1) * self.length].long()


class ResumableLoader(DataLoader):
    """A DataLoader whose place in the data is part of the checkpoint: its `state_dict()` is the epoch
    and the batches of it already yielded, and after `load_state_dict()` it goes on from there."""

    def __init__(self, dataset: Dataset, batch_size: int, sampler: DistributedSampler) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
        self.epoch = 0
        self.batches_done = 0

    def __iter__(self) -> Any:
        # Fabric sets the sampler's epoch to the number of `iter()` calls, which restarts at 0 in a
        # resumed run; this loader counts its own.
        self.sampler.set_epoch(self.epoch)
        for index, batch in enumerate(super().__iter__()):
            if index >= self.batches_done:  # skip what the checkpointed run already trained on
                self.batches_done = index + 1
                yield batch
        self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]


@dataclass
class StdlibBytes(DataModule):
    """The Python standard library's source, one token per byte; the last `val_fraction` validates."""

    max_bytes: int = 2_000_000
    """Corpus size (the stdlib's `.py` files in path order, cut here)."""
    val_fraction: float = 0.1
    seed: int = 42
    """Seeds the order of the training blocks (the same on every rank; the sampler splits them)."""

    batch_size: int = field(default=1, init=False, repr=False)
    seq_length: int = field(default=2, init=False, repr=False)
    train_tokens: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    val_tokens: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def connect(
        self, tokenizer: Optional[Tokenizer] = None, batch_size: int = 1, max_seq_length: Optional[int] = None
    ) -> None:
        assert tokenizer is None and max_seq_length is not None, "bytes need no tokenizer; the model sets the length"
        self.batch_size = batch_size
        self.seq_length = max_seq_length + 1  # one token more: the last input's target

    def setup(self, stage: str = "") -> None:
        tokens = read_corpus(self.max_bytes)  # (L,) uint8
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]

    def train_dataloader(self) -> DataLoader:
        dataset = TokenBlocks(self.train_tokens, self.seq_length)
        # the sampler given here, rather than Fabric's, is what lets the loader resume mid-epoch
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=self.seed, drop_last=True)
        return ResumableLoader(dataset, self.batch_size, sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenBlocks(self.val_tokens, self.seq_length), batch_size=self.batch_size)


# ---- LitGPT's setup(), with a strategy --------------------------------------------------------------
def parse(argv: Optional[list[str]]) -> tuple[str, list[str], Any]:
    """`--strategy` (ours), the rest (`litgpt pretrain`'s), and those parsed and instantiated."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--strategy", default="zero3")
    known, litgpt_argv = ours.parse_known_args(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(description="`litgpt pretrain`'s arguments, plus --strategy NAME (default: zero3).")
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(pretrain.setup)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # the name before jsonargparse 4.49
    return known.strategy, litgpt_argv, instantiate(parser.parse_args(litgpt_argv))


def main(argv: Optional[list[str]] = None) -> None:
    strategy, litgpt_argv, args = parse(argv)
    # as in LitGPT's setup()
    config = Config.from_name(args.model_name) if args.model_config is None else args.model_config
    precision = args.precision or get_default_supported_precision(training=True)
    devices = parse_devices(args.devices)
    out_dir = init_out_dir(args.out_dir)
    tokenizer_dir = extend_checkpoint_dir(args.tokenizer_dir) if args.tokenizer_dir is not None else None
    initial_checkpoint_dir = extend_checkpoint_dir(args.initial_checkpoint_dir) if args.initial_checkpoint_dir else None
    logger = choose_logger(
        args.logger_name, out_dir, name=f"pretrain-{config.name}", resume=bool(args.resume),
        log_interval=args.train.log_interval, log_args=asdict(args.log),
    )  # fmt: skip
    fabric = L.Fabric(devices=devices, num_nodes=args.num_nodes, strategy=strategy, precision=precision, loggers=[logger])
    if torch.cuda.is_available() and devices > 1:
        check_nvlink_connectivity(fabric)
    fabric.launch()  # each other rank re-runs this script with the whole command line, --strategy included
    # LitGPT's save_checkpoint() writes hyperparameters.yaml by parsing sys.argv against its own setup():
    # give it the arguments that are its own
    sys.argv[1:] = litgpt_argv

    pretrain.main(
        fabric=fabric,
        devices=devices,
        num_nodes=args.num_nodes,
        seed=args.seed,
        initial_checkpoint_dir=initial_checkpoint_dir,
        resume=args.resume,
        config=config,
        data=args.data,
        out_dir=out_dir,
        tokenizer_dir=tokenizer_dir,
        tokenizer=Tokenizer(tokenizer_dir) if tokenizer_dir is not None else None,
        train=args.train,
        eval=args.eval,
        optimizer=args.optimizer,
    )


if __name__ == "__main__":
    main()

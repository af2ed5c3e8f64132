"""How the adapters write a ``state_dict_type="full"`` checkpoint file with Lightning's
``CheckpointIO``: the one piece of checkpoint writing that depends on Lightning, handed to
``ZeroCheckpointing`` by both strategies (the Trainer's and Fabric's), so ``lightning_zero.checkpoint``
imports no Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero.checkpoint.pickles import save_torch_file


def file_writer(checkpoint_io: Any) -> Callable[[dict[str, Any], Path], None]:
    """How a ``state_dict_type="full"`` file is written with the strategy's ``checkpoint_io``.

    Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory before writing it
    (for atomicity), a second copy of the checkpoint on rank 0. ``ZeroCheckpointing.save`` already
    writes a temporary sibling and moves it into place once complete, so with that IO ``torch.save``
    streams the same bytes straight to the file: rank 0 holds the checkpoint once. Any other IO
    (a user's, a remote filesystem's) writes as it always does."""
    if type(checkpoint_io) is TorchCheckpointIO:
        return _stream_to_file
    return lambda checkpoint, path: checkpoint_io.save_checkpoint(checkpoint, path)


def _stream_to_file(checkpoint: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_torch_file(checkpoint, path)

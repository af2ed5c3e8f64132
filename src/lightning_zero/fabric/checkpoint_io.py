"""How the adapters write a ``state_dict_type="full"`` checkpoint file with Lightning's
``CheckpointIO``: the one piece of checkpoint writing that depends on Lightning, handed to
``ZeroCheckpointing`` by both strategies (the Trainer's and Fabric's), so ``lightning_zero.checkpoint``
imports no Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Union

from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero.checkpoint import remote
from lightning_zero.checkpoint.locations import RemoteLocation
from lightning_zero.checkpoint.pickles import save_torch_file


def file_writer(checkpoint_io: Any) -> Callable[[dict[str, Any], Union[Path, RemoteLocation]], None]:
    """How a ``state_dict_type="full"`` file is written with the strategy's ``checkpoint_io``.

    Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory before writing it
    (for atomicity), a second copy of the checkpoint on rank 0. ``ZeroCheckpointing.save`` already
    writes a temporary sibling and moves it into place once complete, so with that IO ``torch.save``
    streams the same bytes straight to the file: rank 0 holds the checkpoint once. Any other IO
    (a user's) writes as it always does, given a URL's text and ``storage_options``. At a URL,
    ``torch.save`` streams into one upload, published only once complete (``remote.write_file``)."""
    if type(checkpoint_io) is TorchCheckpointIO:
        return _stream_to_file

    def write(checkpoint: dict[str, Any], path: Union[Path, RemoteLocation]) -> None:
        if isinstance(path, RemoteLocation):
            checkpoint_io.save_checkpoint(checkpoint, path.url, storage_options=path.storage_options or None)
        else:
            checkpoint_io.save_checkpoint(checkpoint, path)

    return write


def _stream_to_file(checkpoint: dict[str, Any], path: Union[Path, RemoteLocation]) -> None:
    if isinstance(path, RemoteLocation):
        remote.write_file(path, lambda stream: save_torch_file(checkpoint, stream))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    save_torch_file(checkpoint, path)

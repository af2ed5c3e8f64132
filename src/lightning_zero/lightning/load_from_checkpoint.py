"""``MyModel.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` for the sharded
checkpoint directories ``ModelCheckpoint`` writes by default.

Lightning's ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read the path
with ``lightning.fabric.utilities.cloud_io._load``, imported into ``lightning.pytorch.core.saving``
as ``pl_load``, which opens it as one file: on a directory, a bare ``IsADirectoryError``. ``install``
(run by ``import lightning_zero``) wraps that one name: a local directory is read as its single-file
form (``checkpoint_file``: full weights and the rest of the checkpoint, no optimizer state, in this
process alone, no process group) and handed to Lightning's reader, so ``map_location`` and
``weights_only`` mean what they mean for a file; every other path goes to Lightning's reader
untouched. The cost is the single-file form in memory once, as for a file.

``torch.load(directory)`` is torch's own and stays a bare error: give it ``checkpoint_file(path)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Callable, Union

from lightning.pytorch.core import saving

from lightning_zero.checkpoint.convert import checkpoint_file


class ReadsShardedDirectories:
    """Lightning's checkpoint reader, with local directories read through ``checkpoint_file``."""

    def __init__(self, read: Callable[..., Any]) -> None:
        self.read = read

    def __call__(self, path_or_url: Union[IO, str, Path], *args: Any, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, Path)) and os.path.isdir(path_or_url):
            path_or_url = checkpoint_file(path_or_url)
        return self.read(path_or_url, *args, **kwargs)


def install() -> None:
    """Wrap ``lightning.pytorch.core.saving.pl_load`` once (a no-op where Lightning has no such name)."""
    read = getattr(saving, "pl_load", None)
    if read is not None and not isinstance(read, ReadsShardedDirectories):
        saving.pl_load = ReadsShardedDirectories(read)


__all__ = ["ReadsShardedDirectories", "install"]

"""``MyModel.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` for the sharded
checkpoint directories ``ModelCheckpoint`` writes by default.

Lightning's ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read the path
with ``lightning.fabric.utilities.cloud_io._load``, imported into ``lightning.pytorch.core.saving``
as ``pl_load``, which opens it as one file: on a directory, a bare ``IsADirectoryError``. ``install``
(run by ``import lightning_zero``) wraps that one name: a local directory (or a sharded checkpoint at
a URL) is read as its single-file
form (``checkpoint_file``: full weights and the rest of the checkpoint, no optimizer state, in this
process alone, no process group) and handed to Lightning's reader, so ``map_location`` and
``weights_only`` mean what they mean for a file (meta.pt is unpickled under the same
``weights_only``; see [Note: untrusted checkpoints] in ``checkpoint/pickles.py``); every other path
goes to Lightning's reader untouched. The cost is the single-file form in memory once, as for a file.

``install`` also allows Lightning's ``AttributeDict`` (hyperparameters) in checkpoints loaded with
``weights_only=True`` (``allow_in_checkpoints``).

A checkpoint saved without its frozen weights (``save_frozen=False``) leaves them out of its
single-file form too (``FROZEN_KEY`` says which). ``install`` also wraps Lightning's
``saving._load_state`` (``KeepsFrozenWeights``): for such a checkpoint, right after the module's
``on_load_checkpoint`` (so after ``__init__`` and ``configure_model`` loaded the base) the module's
own frozen weights are checked against the checkpoint's fingerprint and put into the ``state_dict``
being loaded, so that strict loading finds every key and the base stays as loaded.

``torch.load(directory)`` is torch's own and stays a bare error: give it ``checkpoint_file(path)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterator, Union

from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch import LightningModule
from lightning.pytorch.core import saving
from lightning.pytorch.utilities.parsing import AttributeDict

from lightning_zero.checkpoint.convert import checkpoint_file
from lightning_zero.checkpoint.frozen_merge import FROZEN_KEY, fill_from_module
from lightning_zero.checkpoint.locations import is_remote
from lightning_zero.checkpoint.manifest import is_sharded_checkpoint
from lightning_zero.checkpoint.pickles import allow_in_checkpoints, checkpoint_globals


class ReadsShardedDirectories:
    """Lightning's checkpoint reader, with local directories read through ``checkpoint_file``."""

    def __init__(self, read: Callable[..., Any]) -> None:
        self.read = read

    def __call__(self, path_or_url: Union[IO, str, Path], *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(path_or_url, (str, Path)) and _is_sharded(path_or_url)):
            return self.read(path_or_url, *args, **kwargs)
        # Lightning's `_load(path_or_url, map_location=None, weights_only=None)`
        weights_only = kwargs.get("weights_only", args[1] if len(args) > 1 else None)
        with checkpoint_globals():  # the single-file form holds what meta.pt held
            return self.read(checkpoint_file(path_or_url, weights_only), *args, **kwargs)


class KeepsFrozenWeights:
    """Lightning's ``_load_state(cls, checkpoint, strict=None, **kwargs)``, keeping the module's own
    frozen weights where the checkpoint left them out (see above)."""

    def __init__(self, load_state: Callable[..., Any]) -> None:
        self.load_state = load_state

    def __call__(self, cls: Any, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        left_out = checkpoint.get(FROZEN_KEY) if isinstance(checkpoint, dict) else None
        if left_out is None or not issubclass(cls, LightningModule):
            return self.load_state(cls, checkpoint, *args, **kwargs)
        checkpoint = {key: value for key, value in checkpoint.items() if key != FROZEN_KEY}
        with _filled_on_load(cls, left_out):
            return self.load_state(cls, checkpoint, *args, **kwargs)


@contextmanager
def _filled_on_load(cls: type, left_out: dict[str, Any]) -> Iterator[None]:
    """``cls.on_load_checkpoint`` (which ``_load_state`` calls right before ``load_state_dict``, with
    the checkpoint it loads) followed by ``fill_from_module``, for the length of one load."""
    own = cls.__dict__.get("on_load_checkpoint")
    hook = cls.on_load_checkpoint

    def on_load_checkpoint(self: LightningModule, checkpoint: dict[str, Any]) -> None:
        hook(self, checkpoint)
        fill_from_module(checkpoint["state_dict"], self, left_out, "The checkpoint given to `load_from_checkpoint`")

    cls.on_load_checkpoint = on_load_checkpoint
    try:
        yield
    finally:
        if own is None:
            del cls.on_load_checkpoint
        else:
            cls.on_load_checkpoint = own


def _is_sharded(path: Union[str, Path]) -> bool:
    """A local directory, or a sharded checkpoint at a URL (a file there goes to Lightning's reader)."""
    return is_sharded_checkpoint(path) if is_remote(path) else os.path.isdir(path)


def install() -> None:
    """Wrap ``lightning.pytorch.core.saving.pl_load`` once (a no-op where Lightning has no such name),
    and allow Lightning's hyperparameter container in weights-only loads."""
    allow_in_checkpoints(FabricAttributeDict, AttributeDict)
    read = getattr(saving, "pl_load", None)
    if read is not None and not isinstance(read, ReadsShardedDirectories):
        saving.pl_load = ReadsShardedDirectories(read)
    load_state = getattr(saving, "_load_state", None)
    if load_state is not None and not isinstance(load_state, KeepsFrozenWeights):
        saving._load_state = KeepsFrozenWeights(load_state)


__all__ = ["KeepsFrozenWeights", "ReadsShardedDirectories", "install"]

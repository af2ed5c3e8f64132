"""Checkpoint plumbing that needs Lightning's Trainer: ``RecoveringLauncher``, which puts back
checkpoints that a crash left under a sibling name before Lightning resolves ``ckpt_path="last"``
(see ``checkpoint/atomic.py``), and the optimizer unwrapping the strategy's hooks need. What the
checkpoint calls themselves do is ``lightning_zero.checkpoint.checkpointing.ZeroCheckpointing``,
shared with the Fabric strategy.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, Optional, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning, OnExceptionCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch.optim import Optimizer

from lightning_zero.checkpoint.atomic import recover_folder
from lightning_zero.checkpoint.checkpointing import StateDictType, ZeroCheckpointing

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning before 2.6 has no weight-averaging callbacks of this kind
    WeightAveraging = None

__all__ = [
    "RecoveringLauncher",
    "RecoveringMultiProcessingLauncher",
    "StartMethod",
    "StateDictType",
    "check_start_method",
    "ZeroCheckpointing",
    "check_callbacks_can_save",
    "checkpoint_folders",
    "unwrap_optimizer",
]


StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def check_start_method(start_method: str) -> str:
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method={start_method!r} is not one of {', '.join(map(repr, get_args(StartMethod)))}.")
    return start_method


class _RecoversCheckpoints:
    """A Lightning launcher that first puts back the checkpoints that a save interrupted while
    replacing them left under a sibling name (``checkpoint/atomic.py``), in the folders where
    ``ckpt_path="last"`` looks: Lightning resolves "last" before the strategy sees a path, and
    would otherwise start again from step 0."""

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            for folder in checkpoint_folders(trainer):
                recover_folder(folder)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class RecoveringLauncher(_RecoversCheckpoints, _SubprocessScriptLauncher):
    """``start_method="popen"``: ranks started as scripts."""


class RecoveringMultiProcessingLauncher(_RecoversCheckpoints, _MultiProcessingLauncher):
    """``start_method="spawn"|"fork"|"forkserver"``: ranks started from the calling process, which
    gets rank 0's results back (at stage 3 its weights are full again after teardown)."""


def checkpoint_folders(trainer: "pl.Trainer") -> set[str]:
    """Where ``ckpt_path="last"`` looks: each ``ModelCheckpoint``'s folder, resolved by its own rule
    (its ``dirpath``, else the logger's), and each ``OnExceptionCheckpoint``'s."""
    folders = set()
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # private in Lightning 2.x
            folder = callback.dirpath if callback.dirpath is not None or resolve is None else resolve(trainer)
        elif isinstance(callback, OnExceptionCheckpoint):
            folder = callback.dirpath
        else:
            continue
        if folder is not None:
            folders.add(os.fspath(folder))
    return folders


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def check_callbacks_can_save(trainer: "pl.Trainer", state_dict_type: StateDictType) -> None:
    """At setup: refuse what would fail at the first save, before training time is spent. Lightning's
    weight-averaging callbacks, and ModelPruning when it makes pruning permanent in checkpoints,
    replace a checkpoint's ``state_dict`` with full weights, which a sharded directory cannot hold
    (``checkpoint/directory.py``)."""
    if state_dict_type != "sharded" or not trainer.checkpoint_callbacks:
        return
    for callback in trainer.callbacks:
        if WeightAveraging is not None and isinstance(callback, WeightAveraging):
            what = "the averaged model's full weights"
        elif isinstance(callback, ModelPruning) and callback._make_pruning_permanent:
            what = "the pruned model's full weights (masks applied)"
        else:
            continue
        raise ValueError(
            f"{type(callback).__name__} puts {what} into every checkpoint's `state_dict`, which"
            " lightning-zero's sharded checkpoint directories cannot hold, and a ModelCheckpoint would"
            ' save one. HINT: `ZeroStrategy(..., state_dict_type="full")` saves one file instead.'
        )

"""How the Trainer's ranks are started (``ZeroStrategy(start_method=...)``): Lightning's two
launchers, each with two additions.

- Before a run, checkpoints that a save interrupted while replacing them left under a sibling name
  are put back (``checkpoint/atomic.py``) in the folders where ``ckpt_path="last"`` looks: Lightning
  resolves "last" before the strategy sees a path, and would otherwise start again from step 0.
- A spawned rank that finished its work leaves the way a forked one does (multiprocessing ends a
  forked child with ``os._exit`` after the exit handlers; a spawned one with ``sys.exit``, which
  tears down the interpreter). That teardown, with torch's process groups and device meshes still
  referenced, aborts now and then ("terminate called without an active exception": 3 of 20 bare
  two-rank gloo launches on torch 2.13, 4 of 6 zero3 validate runs), and the calling process then
  raises ``ProcessExitedException`` for a run that finished. Lightning's ``ddp_spawn`` has the same
  flaw. A rank that raised still exits as before, so its traceback reaches the calling process.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable, Literal, Optional, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_zero.checkpoint.atomic import recover_folder

__all__ = ["RecoveringLauncher", "RecoveringMultiProcessingLauncher", "StartMethod", "check_start_method", "checkpoint_folders"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def check_start_method(start_method: str) -> str:
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method={start_method!r} is not one of {', '.join(map(repr, get_args(StartMethod)))}.")
    return start_method


class _RecoversCheckpoints:
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

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # rank 0's results are in the (unbuffered) queue
        if self._start_method == "spawn":
            _exit_as_forked_processes_do()


def _exit_as_forked_processes_do() -> None:
    atexit._run_exitfuncs()  # what sys.exit would run first: logging, multiprocessing's finalizers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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

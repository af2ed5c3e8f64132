"""How the Trainer's ranks are started (``ZeroStrategy(start_method=...)``): Lightning's two
launchers, each with one addition.

Before a run, checkpoints that a save interrupted while replacing them left under a sibling name
are put back (``checkpoint/atomic.py``) in the folders where ``ckpt_path="last"`` looks: Lightning
resolves "last" before the strategy sees a path, and would otherwise start again from step 0. In
``default_root_dir``, where SLURM's preemption checkpoints go (``preemption.py``), what interrupted
saves of them left is then deleted, so that Lightning's auto-resume finds the newest complete one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, Optional, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_zero.checkpoint.atomic import discard_leftovers, recover_folder
from lightning_zero.checkpoint.locations import is_remote
from lightning_zero.engine.engine import linked_engine

__all__ = ["RecoveringLauncher", "RecoveringMultiProcessingLauncher", "StartMethod", "check_start_method", "checkpoint_folders"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def check_start_method(start_method: str) -> str:
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method={start_method!r} is not one of {', '.join(map(repr, get_args(StartMethod)))}.")
    return start_method


class _RecoversCheckpoints:
    """A Lightning launcher that first puts back interrupted checkpoints (see the module docstring)."""

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            wait = getattr(getattr(trainer, "strategy", None), "wait_for_checkpoint", None)
            if wait is not None:  # a save still in flight (async_save) is no interrupted one: let it commit
                wait()
            # at a URL there is nothing to put back: a save commits by its manifest (checkpoint/remote.py)
            for folder in checkpoint_folders(trainer) | {os.fspath(trainer.default_root_dir)}:
                if not is_remote(folder):
                    recover_folder(folder)
            if not is_remote(trainer.default_root_dir):
                discard_leftovers(trainer.default_root_dir, HPC_CHECKPOINT_PREFIX)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class RecoveringLauncher(_RecoversCheckpoints, _SubprocessScriptLauncher):
    """``start_method="popen"``: ranks started as scripts."""


class RecoveringMultiProcessingLauncher(_RecoversCheckpoints, _MultiProcessingLauncher):
    """``start_method="spawn"|"fork"|"forkserver"``: ranks started from the calling process, which
    gets rank 0's results back, its full weights included: at stage 3, where the module stays
    sharded after ``fit``, they are gathered one unit at a time and kept on rank 0 alone."""

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Any:
        module = trainer.lightning_module
        engine = linked_engine(module)
        if engine is None:
            return super()._collect_rank_zero_results(trainer, results)
        full = engine.full_state_dict(module, keep=self._strategy.local_rank == 0)  # a collective
        with _state_dict_is(module, full):
            return super()._collect_rank_zero_results(trainer, results)


@contextmanager
def _state_dict_is(module: "pl.LightningModule", state_dict: dict[str, Any]) -> Iterator[None]:
    """Lightning's launcher asks the module for its ``state_dict``; at stage 3 it gets the one
    gathered for it (the module's own would read parameters at rest)."""
    module.state_dict = lambda *args, **kwargs: state_dict  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.state_dict


HPC_CHECKPOINT_PREFIX = "hpc_ckpt_"
"""How Lightning names the checkpoints it saves and resumes from under SLURM (``hpc_ckpt_<N>.ckpt``)."""


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

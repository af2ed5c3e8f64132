"""Checkpoint plumbing that needs Lightning's Trainer: which callbacks can save what, and the
optimizer unwrapping the strategy's hooks need. What the checkpoint calls themselves do is
``lightning_zero.checkpoint.checkpointing.ZeroCheckpointing``, shared with the Fabric strategy; the
launchers that recover interrupted checkpoints before a run are in ``launchers.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_zero.checkpoint.checkpointing import StateDictType
from lightning_zero.checkpoint.locations import check_locations

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning before 2.6 has no weight-averaging callbacks of this kind
    WeightAveraging = None

__all__ = [
    "check_callbacks_can_save",
    "check_checkpoint_locations",
    "has_weight_averaging",
    "unwrap_optimizer",
]


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def has_weight_averaging(trainer: "pl.Trainer") -> bool:
    """A Lightning ``WeightAveraging`` callback (EMA) is among the Trainer's: a fit resumed from a
    sharded directory then hands it the checkpoint's average and training weights, as this rank's
    chunks (``sharded_averaging.py`` loads them)."""
    return WeightAveraging is not None and any(isinstance(callback, WeightAveraging) for callback in trainer.callbacks)


def check_callbacks_can_save(trainer: "pl.Trainer", state_dict_type: StateDictType) -> None:
    """At setup: refuse what would fail at the first save, before training time is spent.
    ModelPruning, when it makes pruning permanent in checkpoints, replaces a checkpoint's
    ``state_dict`` with the pruned model's full weights, which a sharded directory cannot hold
    (``checkpoint/directory.py``; a weight-averaging callback's average it does hold)."""
    if state_dict_type != "sharded" or not trainer.checkpoint_callbacks:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, ModelPruning) and callback._make_pruning_permanent:
            raise ValueError(
                f"{type(callback).__name__} puts the pruned model's full weights (masks applied) into every"
                " checkpoint's `state_dict`, which lightning-zero's sharded checkpoint directories cannot hold,"
                ' and a ModelCheckpoint would save one. HINT: `ZeroStrategy(..., state_dict_type="full")` saves'
                " one file instead, or `ModelPruning(..., make_pruning_permanent=False)` keeps the masks apart."
            )


def check_checkpoint_locations(trainer: "pl.Trainer") -> None:
    """At setup, on every rank: every directory checkpoints will be saved in that is a URL has its
    fsspec package installed (see ``checkpoint/locations.py``): each checkpointing callback's (ModelCheckpoint's, resolved by its
    own setup, which ran before the strategy's; OnExceptionCheckpoint's), and ``default_root_dir``
    where a preemption under SLURM saves there."""
    locations = [(f"{type(c).__name__}(dirpath=...)", getattr(c, "dirpath", None)) for c in trainer.callbacks]
    environment = trainer.strategy.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        locations.append(("`default_root_dir`, where a preemption saves,", trainer.default_root_dir))
    check_locations(locations)

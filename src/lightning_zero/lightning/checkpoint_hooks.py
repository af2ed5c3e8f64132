"""What ``ZeroStrategy``'s checkpoint hooks hand Lightning and take from it: the module's and
each optimizer's state for a save (this rank's chunks for a sharded directory, full state on rank 0
for one file), and the checkpoint a load returns to the Trainer. The reading and writing itself is
``ZeroCheckpointing``'s (``lightning_zero.checkpoint.checkpointing``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing
from lightning_zero.checkpoint.layout import as_trainer_checkpoint
from lightning_zero.checkpoint.manifest import PathLike
from lightning_zero.engine import ZeroEngine
from lightning_zero.lightning.checkpointing import has_weight_averaging, unwrap_optimizer


def module_state_dict(
    checkpointing: ZeroCheckpointing,
    module: LightningModule,
    engine: Optional[ZeroEngine],
    is_global_zero: bool,
    replicated: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Sharded: this rank's chunks. Full: the whole weights, at stage 3 gathered one unit at a
    time and kept on rank 0 only (the rank that writes the file); ``replicated()`` below stage 3."""
    if checkpointing.saves_directory(engine):
        return checkpointing.module_shards(module, engine)
    if engine is not None and engine.shards_parameters:
        return engine.full_state_dict(module, keep=is_global_zero)
    return replicated()  # full parameters on every rank


def optimizer_state(
    checkpointing: ZeroCheckpointing,
    engine: Optional[ZeroEngine],
    optimizers: list[Optimizer],
    optimizer: Optimizer,
    is_global_zero: bool,
) -> Any:
    """Sharded: this rank's chunks of the state. Full: the state in DDP's format, on rank 0."""
    optimizer = unwrap_optimizer(optimizer)
    if engine is None:
        return optimizer.state_dict()
    if checkpointing.saves_directory(engine):
        return checkpointing.optimizer_shards(engine, optimizers, optimizer)
    return engine.full_optimizer_state_dict(optimizer, keep=is_global_zero)


def load_checkpoint(
    checkpointing: ZeroCheckpointing,
    checkpoint_path: PathLike,
    module: LightningModule,
    engine: Optional[ZeroEngine],
    optimizers: list[Optimizer],
    has_schedulers: bool,
    read_file: Callable[[Any], dict[str, Any]],
    weights_only: Optional[bool],
) -> dict[str, Any]:
    """The checkpoint at ``checkpoint_path`` as the Trainer restores it: a sharded directory is read
    into the shards already (the optimizers' too when fitting); a file is read with ``read_file``."""
    trainer = module._trainer  # None in the calling process after spawned ranks finished
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    checkpoint = checkpointing.load(
        checkpoint_path, module, engine, optimizers if fitting else [], module.strict_loading,
        read_file=read_file,
        weights_only=weights_only,
        averaging_states=fitting and has_weight_averaging(trainer),
    )  # fmt: skip
    return as_trainer_checkpoint(checkpoint, has_schedulers=has_schedulers)  # one saved by Fabric

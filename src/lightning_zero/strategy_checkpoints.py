"""The checkpoint half of ``ZeroStrategy``: what Lightning's checkpoint calls do under ZeRO.

A mixin, so that the strategy class reads as the training-step adapter and this file as its
checkpoint plumbing; both act on the same state (the engine, the options). Formats and their
guarantees are in the ``lightning_zero.checkpoint`` package.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.atomic import commit, temporary_sibling
from lightning_zero.checkpoint.directory import load_directory, save_directory
from lightning_zero.checkpoint.sharded import CheckpointGroup, model_tensors, optimizer_shards
from lightning_zero.engine import ZeroEngine


class ZeroCheckpointing(DDPStrategy):
    """Sharded directories by default, one DDP-format file with ``state_dict_type="full"``."""

    state_dict_type: str
    shards_parameters: bool
    _engine: Optional[ZeroEngine]
    _finished: Optional[ZeroEngine]
    _checkpoint_group: CheckpointGroup
    _restored_from_directory: bool

    @property
    def _state_engine(self) -> Optional[ZeroEngine]:
        """The engine holding the optimizer's shards: the running one, or the finished run's."""
        return self._engine if self._engine is not None else self._finished

    @property
    def _saves_directory(self) -> bool:
        return self.state_dict_type == "sharded" and self._state_engine is not None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's chunks (no communication). Full: the whole weights, at stage 3
        gathered one unit at a time and kept on rank 0 only (the rank that writes the file)."""
        if self._saves_directory:
            return model_tensors(self.lightning_module, self._state_engine, self._checkpoint_group.mesh)
        if self._engine is not None and self.shards_parameters:
            return self._engine.full_state_dict(self.lightning_module, keep=self.is_global_zero)
        return super().lightning_module_state_dict()  # full parameters on every rank

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Any:
        """Sharded: this rank's chunks of the state. Full: the state in DDP's format, on rank 0."""
        optimizer = unwrap_optimizer(optimizer)
        engine = self._state_engine
        if engine is None:
            return optimizer.state_dict()
        if self._saves_directory:
            index = [id(o) for o in self.optimizers].index(id(optimizer))
            return optimizer_shards(engine, optimizer, index, self._checkpoint_group.mesh)
        return engine.full_optimizer_state_dict(optimizer, keep=self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write ``filepath`` (a directory when sharded, else a file) so that it appears only once
        complete: an interrupted save leaves the previous checkpoint there untouched."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint takes no `storage_options`; it writes local files.")
        path = Path(self.broadcast(str(filepath)))
        temporary = temporary_sibling(path, self.broadcast(uuid.uuid4().hex[:8]))
        if self._saves_directory:
            engine, group = self._state_engine, self._checkpoint_group
            save_directory(temporary, checkpoint, self.lightning_module, engine, self.stage, self.world_size, group)
        elif self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, temporary)
        self.barrier("lightning_zero.save_checkpoint")
        if self.is_global_zero:
            commit(temporary, path)
        self.barrier("lightning_zero.save_checkpoint.commit")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory is read straight into the shards (any world size, any stage); a
        file — ours with ``state_dict_type="full"``, or one written by DDP — the usual way."""
        path = Path(checkpoint_path)
        self._restored_from_directory = path.is_dir()
        if not path.is_dir():
            if not path.exists():
                raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
            try:
                return super().load_checkpoint(path, weights_only)
            except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
                raise ValueError(f"Checkpoint {str(path)!r} is truncated or corrupted ({type(err).__name__}: {err}).") from err
        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        # the weights and optimizer states go straight into the shards; Lightning restores the
        # rest (loops, schedulers, precision, callbacks) from what this returns
        return load_directory(path, module, self._engine, optimizers, module.strict_loading, self._checkpoint_group)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored_from_directory:
            return  # done in load_checkpoint
        if self._engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds state for {len(states)} optimizers, but `configure_optimizers`"
                f" returned {len(self.optimizers)}."
            )
        for optimizer, state in zip(self.optimizers, states):
            self._engine.load_full_optimizer_state_dict(optimizer, state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._restored_from_directory:
            return  # done in load_checkpoint
        if self._engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._engine.load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

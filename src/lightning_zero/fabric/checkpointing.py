"""``FabricCheckpointing``: ``fabric.save`` / ``fabric.load`` and the strategy's state-dict getters
and loaders, for the modules set up with ``ZeroFabricStrategy``.

It maps Fabric's checkpoint ``state`` onto the Trainer's layout (``checkpoint_state.py``) and hands
the writing and reading to ``ZeroCheckpointing``, so a Trainer checkpoint loads here and the other
way round, at any world size and stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.checkpointing import RankCoordination, ZeroCheckpointing, check_file
from lightning_zero.checkpoint.convert import full_checkpoint
from lightning_zero.checkpoint.layout import FABRIC_NAMES, LIGHTNING_VERSION_KEY, MODULE_KEY, OPTIMIZERS_KEY, fabric_names
from lightning_zero.checkpoint.locations import checkpoint_location
from lightning_zero.checkpoint.pickles import checkpoint_globals
from lightning_zero.compat.lightning_api import load_passing_weights_only
from lightning_zero.fabric.checkpoint_io import file_writer
from lightning_zero.fabric.checkpoint_state import (
    INTERNAL_KEYS,
    plain_values,
    remainder,
    restore_plain_values,
    split_state,
)
from lightning_zero.fabric.sharded_module import ShardedModules


class FabricCheckpointing:
    """Saves and loads the modules in ``modules`` (and their optimizers) with ``checkpointing``:
    sharded directories, or one file in Fabric's usual layout with ``state_dict_type="full"``."""

    def __init__(self, modules: ShardedModules, checkpointing: ZeroCheckpointing) -> None:
        self._modules = modules
        self._checkpointing = checkpointing

    # ---- state dicts ---------------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full weights on every rank (at stage 3 gathered one unit at a time), on the CPU."""
        sharded = self._modules.of(module)
        engine = sharded.engine if sharded is not None else None
        return engine.full_state_dict(module) if engine is not None else module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        sharded = self._modules.of(module)
        engine = sharded.ensure_engine() if sharded is not None else None
        if engine is None:
            module.load_state_dict(state_dict, strict=strict)
        else:
            engine.load_full_state_dict(module, state_dict, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as if unsharded (DDP's format), on every rank."""
        sharded = self._modules.owner_of(optimizer)
        engine = sharded.ensure_engine() if sharded is not None else None
        return engine.full_optimizer_state_dict(optimizer) if engine is not None else optimizer.state_dict()

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(
        self,
        ranks: RankCoordination,
        checkpoint_io: Any,
        path: Union[str, Path],
        state: dict[str, Any],
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        """A sharded directory (every rank writes its chunks) or, with ``state_dict_type="full"``, one
        file in Fabric's usual layout, written by rank 0 with ``checkpoint_io``; either appears only
        once complete."""
        if filter:
            raise ValueError(
                "lightning-zero's checkpoints take no `filter`: they hold the whole module. Save a filtered"
                " copy yourself from `fabric.strategy.get_module_state_dict(model)`."
            )
        clashing = [key for key in state if key in INTERNAL_KEYS]
        if clashing:
            raise ValueError(f"Checkpoint state keys {clashing} are reserved by lightning-zero; rename them.")
        self._modules.close_steps()
        split = split_state(state, self._modules.is_set_up, self._modules.owner_module)
        sharded = self._modules.of(split.module) if split.module is not None else None
        engine = sharded.ensure_engine() if sharded is not None else None
        checkpoint = plain_values(split.others)
        if self._checkpointing.saves_directory(engine):
            assert engine is not None and split.module is not None
            checkpoint[MODULE_KEY] = self._checkpointing.module_shards(split.module, engine)
            checkpoint[OPTIMIZERS_KEY] = [
                self._checkpointing.optimizer_shards(engine, split.optimizers, opt) for opt in split.optimizers
            ]
        else:
            keep = ranks.is_global_zero
            if split.module_key is not None:
                assert split.module is not None
                module_state = engine.full_state_dict(split.module, keep=keep) if engine is not None else split.module.state_dict()
                checkpoint[split.module_key] = module_state
            for key, opt in zip(split.optimizer_keys, split.optimizers):
                checkpoint[key] = engine.full_optimizer_state_dict(opt, keep=keep) if engine is not None else opt.state_dict()
        checkpoint[FABRIC_NAMES] = {"module": split.module_key, "optimizers": split.optimizer_keys}
        checkpoint[LIGHTNING_VERSION_KEY] = lightning.__version__
        self._checkpointing.save(
            ranks, checkpoint, path, split.module or nn.Module(), engine,
            write_file=file_writer(checkpoint_io), storage_options=storage_options,
        )  # fmt: skip

    def load(
        self,
        checkpoint_io: Any,
        path: Union[str, Path],
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]],
        strict: bool,
        weights_only: Optional[bool],
        load_plain: Callable[..., dict[str, Any]],
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint saved by ``ZeroFabricStrategy`` (either format) or by the
        Trainer under ``ZeroStrategy`` or DDP, at any world size and stage; returns what was not
        restored. ``state=None``: the whole checkpoint as plain full tensors. ``load_plain``: how
        Fabric's DDP loads a state that holds no module set up here."""
        self._modules.close_steps()
        self._checkpointing.wait()  # a save in flight may be the very checkpoint asked for
        location = checkpoint_location(path)
        folder = self._checkpointing.sharded_folder(location)  # a local one put back first, if a crash left it aside
        path = location

        def read_file(file: Any) -> Any:
            with checkpoint_globals():  # a file loads as a directory's meta.pt does
                return load_passing_weights_only(checkpoint_io.load_checkpoint, file, weights_only)

        if not state:
            if folder is not None:
                return full_checkpoint(folder, include_optimizer=True, weights_only=weights_only)
            return read_file(check_file(location))
        if isinstance(state, nn.Module):  # `fabric.load_raw(path, module)`
            self._load_module(path, state, strict, read_file, weights_only)
            return {}
        if isinstance(state, Optimizer):  # `fabric.load_raw(path, optimizer)`
            self._load_full_optimizer_state(state, read_file(check_file(location)))
            return {}
        split = split_state(state, self._modules.is_set_up, self._modules.owner_module)
        if split.module is None:
            if folder is not None:
                raise ValueError(f"{str(path)!r} is a lightning-zero checkpoint: its state must include the module it holds.")
            return load_passing_weights_only(load_plain, check_file(location), weights_only, state, strict)
        sharded = self._modules.of(split.module)
        assert sharded is not None
        engine = sharded.ensure_engine()
        checkpoint = self._checkpointing.load(
            path, split.module, engine, split.optimizers if engine is not None else [], strict, read_file, weights_only
        )
        if not self._checkpointing.restored_from_directory:
            self._load_from_file(checkpoint, split, strict)
        restore_plain_values(state, split.others, checkpoint, strict)
        return remainder(checkpoint)

    def _load_module(
        self, path: Any, module: nn.Module, strict: bool, read_file: Callable[[Path], Any], weights_only: Optional[bool]
    ) -> None:
        """Full weights (a raw ``state_dict`` file, or a checkpoint of either layout) into ``module``."""
        sharded = self._modules.of(module)
        engine = sharded.ensure_engine() if sharded is not None else None
        loaded = self._checkpointing.load(path, module, engine, [], strict, read_file, weights_only)
        if self._checkpointing.restored_from_directory:
            return
        module_key, _ = fabric_names(loaded)
        weights = loaded.get(module_key) if module_key else loaded.get(MODULE_KEY, loaded)
        self.load_module_state_dict(module, weights, strict=strict)

    def _load_from_file(self, checkpoint: dict[str, Any], split: Any, strict: bool) -> None:
        """A full file: Fabric's layout (the module under its key) or the Trainer's (``state_dict``)."""
        key = split.module_key if split.module_key in checkpoint else MODULE_KEY
        if key not in checkpoint:
            raise KeyError(f"The checkpoint holds no weights under {split.module_key!r} or {MODULE_KEY!r}.")
        self.load_module_state_dict(split.module, checkpoint.pop(key), strict=strict)
        for index, (key, optimizer) in enumerate(zip(split.optimizer_keys, split.optimizers)):
            if key in checkpoint:
                self._load_full_optimizer_state(optimizer, checkpoint.pop(key))
            elif index < len(checkpoint.get(OPTIMIZERS_KEY, [])):
                self._load_full_optimizer_state(optimizer, checkpoint[OPTIMIZERS_KEY][index])
            elif strict:
                raise KeyError(f"The checkpoint holds no state for the optimizer under {key!r}.")

    def _load_full_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        sharded = self._modules.owner_of(optimizer)
        engine = sharded.ensure_engine() if sharded is not None else None
        if engine is None:
            optimizer.load_state_dict(state)
        else:
            engine.load_full_optimizer_state_dict(optimizer, state)

"""``ZeroFabricStrategy``: the Fabric adapter around the engine, beside the Trainer's ``ZeroStrategy``.

Fabric calls the strategy from the user's own loop; this class connects those calls to the engine:

- ``fabric.setup`` / ``setup_module`` + ``setup_optimizers``: each module gets a ``ShardedModule``
  (its engine and the step boundaries read from its forward calls, see ``sharded_module.py``);
- ``fabric.backward``: the gradient shards are finished after it;
- ``optimizer.step()``: after the step, the module sees the updated shards;
- ``fabric.clip_gradients``: by the norm of the full gradients, computed from the shards;
- ``fabric.save`` / ``fabric.load``: the Trainer's checkpoint formats (``checkpointing.py``);
- the precision plugins it accepts: ``precision.py``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.checkpointing import StateDictType, ZeroCheckpointing
from lightning_zero.checkpoint.locations import check_storage_options
from lightning_zero.compat.lightning_api import fabric_setup_result
from lightning_zero.engine import MemoryReport, ZeroStage
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.node_links import LazyNodeLinks, check_node_layout
from lightning_zero.engine.zero_plus_plus import GradientQuantization, SecondaryShardSize, WeightQuantization
from lightning_zero.engine.config import STRATEGY_NAMES, OffloadTier, ShardGroupSize, check_shard_group_option, config_from_options
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_
from lightning_zero.engine.host_step_overlap import ScaleOf
from lightning_zero.engine.optimizer.sharded_optimizer import check_optimizer_type
from lightning_zero.fabric.checkpointing import FabricCheckpointing
from lightning_zero.fabric.precision import checked_precision
from lightning_zero.fabric.sharded_module import AccumulateWithoutSync, ShardedModule, ShardedModules


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO data parallelism for Fabric, on the engine the Trainer's ``ZeroStrategy`` uses, with the
    same options (see ``ZeroStrategy`` for each one, ``shard_group_size`` included)::

        fabric = Fabric(strategy="zero3", devices=8, precision="bf16-mixed")
        fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, offload_optimizer=True))

    Checkpoints (``fabric.save`` / ``fabric.load``) are the Trainer's formats: a Trainer checkpoint
    loads here and the other way round, at any world size and stage. ``summon_full_params()`` gives
    full parameters on every rank.

    ``async_save=True``: ``fabric.save`` of a sharded checkpoint returns once this rank's shards are
    staged in host memory and writes in the background, as ``ZeroStrategy``'s option does. Fabric
    has no end of ``fit``: the save in flight is waited for (and a failure raised, on every rank) by
    the next ``fabric.save`` / ``fabric.load``, by ``wait_for_checkpoint()``, by ``teardown()``, and
    at the latest when the process exits (a failure no one waited for is then logged).

    ``save_frozen=False``: ``fabric.save`` leaves the frozen parameters out of sharded checkpoints, as
    ``ZeroStrategy``'s option does; ``fabric.load`` keeps the module's own once they match the
    checkpoint's fingerprint of them.
    """

    strategy_name = "zero_fabric"

    def __init__(
        self,
        stage: int = 2,
        bucket_size_mb: float = 25.0,
        unit_classes: Optional[list[str]] = None,
        min_unit_params: int = 0,
        prefetch_units: int = 1,
        check_units_every_gather: Optional[bool] = None,
        keep_frozen_units_mb: float = 0.0,
        offload_optimizer: OffloadTier = False,
        offload_params: OffloadTier = False,
        nvme_path: Optional[str] = None,
        nvme_buffer_count: int = 4,
        fused_host_step: bool = False,
        overlap_host_step: bool = True,
        host_threads: Optional[int] = None,
        elementwise_optimizers: Optional[list[str]] = None,
        shard_group_size: ShardGroupSize = None,
        secondary_shard_size: SecondaryShardSize = None,
        quantize_weights: WeightQuantization = False,
        quantize_gradients: GradientQuantization = False,
        state_dict_type: StateDictType = "sharded",
        async_save: bool = False,
        save_frozen: bool = True,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        elementwise_optimizers = elementwise_optimizers or ()
        self.zero_config = config_from_options(locals())  # validates before anything else happens
        check_shard_group_option(shard_group_size)
        self.shard_group_size = shard_group_size
        self._groups: Optional[tuple[collectives.ProcessGroup, collectives.ProcessGroup]] = None
        self._links = LazyNodeLinks()  # ZeRO++'s groups
        self._checkpointing = ZeroCheckpointing(state_dict_type, timeout, async_save, save_frozen)
        self._modules = ShardedModules()
        self._checkpoints = FabricCheckpointing(self._modules, self._checkpointing)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self._backward_sync_control = AccumulateWithoutSync(self._modules)

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def state_dict_type(self) -> StateDictType:
        return self._checkpointing.state_dict_type

    @property
    def shards_parameters(self) -> bool:
        return self.zero_config.zero_stage is ZeroStage.PARAMETERS

    # ---- precision ---------------------------------------------------------------------------------
    @property  # type: ignore[override]
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = checked_precision(precision)

    # ---- setup -------------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """At stage 3, ``fabric.init_module()`` builds on the meta device and ``setup`` materializes
        one unit at a time (see ``engine/parameters/materialize.py``); ``empty_init=False`` builds eagerly."""
        if not self.shards_parameters or empty_init is False:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not self.shards_parameters:  # at stage 3 the engine places each chunk (and materializes)
            module.to(self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Any, ...]:
        """``(module, optimizers, scheduler)``; ``(module, optimizers)`` to Lightning 2.5's Fabric."""
        for optimizer in optimizers:
            check_optimizer_type(optimizer)
        self._set_up(module, optimizers)
        return fabric_setup_result(module, optimizers, scheduler)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        collectives.let_workers_finish_at_exit()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._set_up(module, [])
        return module

    def _set_up(self, module: nn.Module, optimizers: list[Optimizer]) -> None:
        if self._modules.of(module) is not None:
            raise ValueError(f"{type(module).__name__} is already set up with lightning-zero; set each module up once.")
        groups = self._data_parallel_groups()
        links = self._links.get(self)
        self._modules.add(ShardedModule(module, self.zero_config, self.root_device, self._timeout, optimizers, groups, links))

    def _data_parallel_groups(self) -> tuple[collectives.ProcessGroup, collectives.ProcessGroup]:
        """(shard group, replicate group), as ``ZeroStrategy`` makes them."""
        if self._groups is None:
            self._groups = collectives.data_parallel_groups(
                self.shard_group_size, self.world_size, self.num_processes, self._timeout
            )
        return self._groups

    @override
    def _set_world_ranks(self) -> None:
        super()._set_world_ranks()
        # Fabric's construction, on every rank: ZeRO++'s options against the node layout
        check_node_layout(self.zero_config, self.shard_group_size, self.world_size, self.num_processes, getattr(self.precision, "precision", None))

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_optimizer_type(optimizer)
        owners = [m for m in self._modules if m.holds_parameters_of(optimizer)]
        if len(owners) != 1:
            raise ValueError(
                f"{type(optimizer).__name__} must step the parameters of exactly one module set up with"
                f" lightning-zero (it steps {len(owners)}'s). Set the module up first"
                " (`model = fabric.setup_module(model)`), then build the optimizer from its parameters."
            )
        owners[0].add_optimizer(optimizer)
        return optimizer

    # ---- the training step ---------------------------------------------------------------------------
    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        scaler = getattr(self.precision, "scaler", None)
        for sharded in self._modules:
            if sharded.engine is not None:
                if scaler is not None and scaler.is_enabled():  # each bucket is unscaled as it arrives (step_ahead.py)
                    # the same plan every backward changes nothing (backing off from redone steps goes on)
                    sharded.engine.plan_host_step(loss_scale=ScaleOf(scaler))
                sharded.engine.before_backward()
        super().backward(tensor, module, *args, **kwargs)
        for sharded in self._modules:
            sharded.after_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        sharded = self._modules.owner_of(optimizer)
        if sharded is None:
            return super().optimizer_step(optimizer, **kwargs)
        engine = sharded.ensure_engine()
        sharded.close_step()
        output = super().optimizer_step(optimizer, **kwargs)
        if engine is not None:
            engine.after_optimizer_step(optimizer)
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the full gradients, computed from this rank's shards
        (one all-reduce); returns the total norm, as under DDP."""
        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        shard_group = self._data_parallel_groups()[0]
        return clip_grads_by_global_norm_(parameters, float(max_norm), self.root_device, float(norm_type), error_if_nonfinite, shard_group)

    @contextmanager
    def summon_full_params(
        self,
        module: Optional[nn.Module] = None,
        writeback: bool = False,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Inside, every parameter of ``module`` (default: of every module set up) is its full tensor
        on every rank; edits are written back to the shards only with ``writeback=True``. Enter it
        on every rank: gathering is a collective. ``rank0_only`` and ``offload_to_cpu`` are FSDP's
        knobs, and ``with_grads`` (full gradients in ``.grad`` too), as in ``ZeroStrategy.summon_full_params``."""
        with ExitStack() as stack:
            for sharded in self._modules.selected(module):
                if sharded.engine is not None:
                    stack.enter_context(
                        sharded.engine.gathered(writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads)
                    )
            yield

    def finish_evaluation(self, module: Optional[nn.Module] = None) -> None:
        """After this rank's last evaluation forward (on every rank): at stage 3, ranks may then run
        different numbers of evaluation forwards, as under DDP — a rank that is done takes part in
        its peers' all-gathers until they are done too (see ``engine/comm/evaluation_join.py``)."""
        for sharded in self._modules.selected(module):
            if sharded.engine is not None:
                sharded.engine.finish_evaluation()

    def memory_report(self, module: Optional[nn.Module] = None) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now for ``module``
        (default: the one module set up)."""
        selected = self._modules.selected(module)
        if len(selected) != 1 or selected[0].ensure_engine() is None:
            raise RuntimeError("memory_report() needs one module set up with its optimizers; pass `module=`.")
        report = selected[0].engine.memory_report()  # type: ignore[union-attr]
        return replace(report, checkpoint_staging=self._checkpointing.staging_bytes)

    def wait_for_checkpoint(self) -> None:
        """Block until the save in flight (``async_save``), if any, has committed; raise its
        ``CheckpointWriteError`` if it failed. Call it on every rank."""
        self._checkpointing.wait()

    @override
    def teardown(self) -> None:
        try:
            self._checkpointing.release()  # the save in flight first; its error after the rest of teardown
        finally:
            self._modules.release()
            super().teardown()

    # ---- state dicts and checkpoints (see ``checkpointing.py``) ------------------------------------------
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full weights on every rank (at stage 3 gathered one unit at a time), on the CPU."""
        return self._checkpoints.module_state_dict(module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_module_state_dict(module, state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as if unsharded (DDP's format), on every rank."""
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self,
        path: Union[str, Path],
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """A sharded directory (every rank writes its chunks) or, with ``state_dict_type="full"``, one
        file in Fabric's usual layout, written by rank 0; either appears only once complete."""
        check_storage_options(path, storage_options)
        self._checkpoints.save(self, self.checkpoint_io, path, state, filter, storage_options)

    @override
    def load_checkpoint(
        self,
        path: Union[str, Path],
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint saved by this strategy (either format) or by the Trainer
        under ``ZeroStrategy`` or DDP, at any world size and stage; returns what was not restored.
        ``state=None``: the whole checkpoint as plain full tensors."""
        return self._checkpoints.load(self.checkpoint_io, path, state, strict, weights_only, load_plain=super().load_checkpoint)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, init_params in STRATEGY_NAMES.items():
            if name not in strategy_registry:  # importing twice is harmless
                strategy_registry.register(name, cls, description=f"ZeRO {init_params} ({cls.__name__})", **init_params)

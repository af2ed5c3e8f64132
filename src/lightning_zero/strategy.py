"""``ZeroStrategy``: the thin Lightning adapter around the engine.

The Trainer keeps launching processes, running loops and calling precision plugins and callbacks;
this class only connects Lightning's hooks to the engine (``lightning_zero.engine``):

- ``setup``: broadcast rank 0's weights (as DDP does), build the optimizers, shard them;
- ``post_backward``: finish the gradient reduce-scatters;
- ``optimizer_step``: after the step, all-gather the updated shards into the parameters;
- ``optimizer_state`` / ``load_optimizer_state_dict``: full (unsharded) optimizer state in
  checkpoints, interchangeable with DDP's.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import MemoryReport, ZeroConfig, ZeroEngine, collectives
from lightning_zero.precision import ZeroPrecision, check_precision_supported, to_zero_precision

STRATEGY_NAMES: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
}
"""Names registered in Lightning's ``StrategyRegistry`` by ``import lightning_zero``."""


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism: each of the N ranks keeps 1/N of the optimizer state (stage 1), of
    the gradients too (stage 2), and trains to the same weights as DDP.

    Args:
        stage: 1 shards optimizer state and fp32 master weights; 2 also shards gradients,
            reduce-scattering them in buckets during backward.
        bucket_size_mb: MiB of parameters whose gradients are reduce-scattered (and updated
            weights all-gathered) in one collective. Larger buckets mean fewer, bigger collectives
            and bigger temporary buffers.
        accelerator: set by the Trainer from ``Trainer(accelerator=...)``.
        parallel_devices: set by the Trainer from ``Trainer(devices=...)``.
        cluster_environment: set by the Trainer; how ranks find each other.
        checkpoint_io: how checkpoint files are written (Lightning's ``CheckpointIO``).
        precision_plugin: set by the Trainer from ``Trainer(precision=...)``.
        process_group_backend: "nccl" on CUDA and "gloo" on CPU unless given.
        timeout: how long a collective may wait for the other ranks before failing.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_size_mb: float = 25.0,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self.zero_config = ZeroConfig(stage=stage, bucket_size_mb=bucket_size_mb)  # validates first
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self._engine: Optional[ZeroEngine] = None

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning picks its plugin from `Trainer(precision=...)`; ours clip sharded gradients
        self._precision_plugin = None if plugin is None else to_zero_precision(plugin)

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine sharding the current ``fit`` (None outside fitting)."""
        return self._engine

    # ---- setup / teardown --------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        check_precision_supported(self.precision_plugin)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # every replica starts from rank 0's weights and buffers, as under DDP
        collectives.broadcast_tensors_(_module_tensors(self.model), src=0, group=None)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._close_engine()
            self._engine = ZeroEngine(self.lightning_module, self.optimizers, self.zero_config)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if not isinstance(optimizer, Optimizer):
                self.optimizers, self.lr_scheduler_configs = [], []  # nothing half-built to tear down
                raise TypeError(
                    "lightning-zero shards torch optimizers: `configure_optimizers` must return"
                    f" `torch.optim.Optimizer` instances (optionally with LR schedulers), got {type(optimizer).__name__}."
                )

    @override
    def teardown(self) -> None:
        self._close_engine()
        super().teardown()

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ---- the training step ---------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.model is not None:
            # DDP re-broadcasts rank 0's buffers (e.g. BatchNorm statistics) before each forward
            collectives.broadcast_tensors_(list(self.model.buffers()), src=0, group=None)
        return super().training_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches that accumulate without stepping (``accumulate_grad_batches``)."""
        engine = self._engine
        if engine is None:
            yield None
            return
        engine.sync_gradients = False
        try:
            yield None
        finally:
            engine.sync_gradients = True

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # no DDP reducer to prepare

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._engine is not None:
            self._engine.finish_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None:
            self._engine.after_optimizer_step(_unwrap(optimizer))
        return output

    # ---- checkpoints -------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state, in the same format as DDP's (a collective on all ranks)."""
        optimizer = _unwrap(optimizer)
        if self._engine is None:
            return optimizer.state_dict()
        return self._engine.full_optimizer_state_dict(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
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
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._engine is not None:
            self._engine.sync_master_weights()

    # ---- introspection -----------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        if self._engine is None:
            raise RuntimeError("memory_report() is available while `trainer.fit` runs (after setup).")
        return self._engine.memory_report()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, init_params in STRATEGY_NAMES.items():
            if name not in strategy_registry:  # importing twice is harmless
                strategy_registry.register(
                    name, cls, description=f"ZeRO stage {init_params['stage']} ({cls.__name__})", **init_params
                )


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _module_tensors(module: Module) -> list[torch.Tensor]:
    return [p.data for p in module.parameters()] + list(module.buffers())

"""A module set up with the Fabric strategy (``ShardedModule``: its engine, its optimizers, its step
boundaries), the strategy's collection of them (``ShardedModules``), and ``fabric.no_backward_sync``
(``AccumulateWithoutSync``).

The Trainer tells the engine where a step begins and ends through its hooks (``training_step``,
``post_backward``, ...). Fabric has none: the user's loop calls the module, ``fabric.backward``
and ``optimizer.step``. So the boundaries are read from those calls — [Note: Fabric step
boundaries]:

- a forward with autograd enabled opens a training step (stage 3 gathers the root unit) unless one
  is open: several forwards may feed one backward;
- a backward the module's outputs took part in (a gradient reached them) finishes the gradients
  (``engine.finish_backward``), and closes the step once every forward of it has been
  backpropagated — a module whose outputs a backward did not reach (a GAN's generator during the
  discriminator's backward, its input detached) is left alone;
- an optimizer step closes the step first, as do checkpoints and the end of training;
- a forward without autograd outside a training step is an evaluation step: opened and closed
  around that forward. Inside an open training step it runs in that step.

At stages 1-2 the engine groups its buckets by optimizer, so it is built only once the module's
optimizers are known: at ``fabric.setup(model, *optimizers)``, else at the first use after
``setup_optimizers`` (a forward, ``no_backward_sync``, a checkpoint). At stage 3 it is built at
setup, sharding the parameters (and materializing a meta-device model unit by unit); optimizers
made later from the sharded parameters are added to it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.wrappers import _unwrap_objects
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.node_links import NodeLinks
from lightning_zero.engine.config import ZeroStage
from lightning_zero.engine.parameters.module_hooks import ModuleHooks


class ShardedModule:
    """``module``'s engine and step boundaries (see [Note: Fabric step boundaries])."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        device: torch.device,
        timeout: Optional[timedelta],
        optimizers: list[Optimizer],
        groups: tuple[collectives.ProcessGroup, collectives.ProcessGroup] = (None, None),
        links: Optional[NodeLinks] = None,
    ) -> None:
        self.module = module
        self.config = config
        self.optimizers = list(optimizers)
        self._device = device
        self._timeout = timeout
        self._groups = groups  # (shard group, replicate group): see ZeroEngine
        self._links = links  # ZeRO++'s groups: see ZeroEngine
        self.engine: Optional[ZeroEngine] = None
        self._step_open = False
        self._evaluating = False
        self._forwards_awaiting_backward = 0
        self._reached_by_backward = False
        if config.zero_stage is ZeroStage.PARAMETERS:
            self._build_engine()  # shards (and materializes) the parameters now
        else:
            module.to(device)
            # every replica starts from rank 0's weights and buffers, as DDP's constructor does
            collectives.broadcast_tensors_([p.data for p in module.parameters()] + list(module.buffers()), src=0, group=None)
            if self.optimizers:
                self._build_engine()
        self._hooks = ModuleHooks()  # left out of pickles and copies of the module (module_hooks.py)
        self._hooks.add_forward_pre(module, self._before_forward)
        self._hooks.add_forward(module, self._after_forward)

    # ---- the engine ----------------------------------------------------------------------------
    def _build_engine(self) -> ZeroEngine:
        shard_group, replicate_group = self._groups
        self.engine = ZeroEngine(
            self.module, self.optimizers, self.config, shard_group, self._device, self._timeout, replicate_group, self._links
        )
        return self.engine

    def ensure_engine(self) -> Optional[ZeroEngine]:
        """The engine, built now at stages 1-2 if it waited for optimizers (None while there are
        none: the module is then used for inference only, replicated as under DDP)."""
        if self.engine is None and self.optimizers:
            self._build_engine()
        return self.engine

    def owns(self, optimizer: Optimizer) -> bool:
        return any(opt is optimizer for opt in self.optimizers)

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer of this module's parameters, set up after the module."""
        if self.engine is not None and self.config.zero_stage is not ZeroStage.PARAMETERS:
            raise RuntimeError(
                f"{type(optimizer).__name__} was set up after {type(self.module).__name__} had started"
                f" training (or was checkpointed): at ZeRO stage {self.config.stage} every optimizer of a"
                " module must be set up before its first forward. Call `fabric.setup_optimizers(...)` with"
                " all of them first, or `fabric.setup(model, *optimizers)`."
            )
        if self.engine is not None:
            self.engine.add_optimizer(optimizer)
        self.optimizers.append(optimizer)

    def holds_parameters_of(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps parameters of this module (before it is sharded)."""
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    # ---- step boundaries -------------------------------------------------------------------------
    @torch._dynamo.disable  # collectives and Python state: run eagerly under torch.compile
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            engine = self.ensure_engine()
            self._evaluating = False
            if not self._step_open:
                if engine is None or engine.sync_gradients:  # DDP syncs buffers unless in `no_sync`
                    collectives.broadcast_tensors_(list(self.module.buffers()), src=0, group=None)
                if engine is not None:
                    engine.begin_step()
                self._step_open = True
        elif not self._step_open and self.engine is not None:
            self.engine.begin_evaluation_step()
            self._step_open = self._evaluating = True

    @torch._dynamo.disable
    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._evaluating:
            self.close_step()
            return
        leaves, _ = tree_flatten(output)
        needing_grad = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and needing_grad:
            self._forwards_awaiting_backward += 1
            register_multi_grad_hook(needing_grad, self._reached, mode="any")

    def _reached(self, grads: Any) -> None:
        self._reached_by_backward = True
        self._forwards_awaiting_backward -= 1

    def after_backward(self) -> None:
        """After each ``fabric.backward`` (see [Note: Fabric step boundaries])."""
        if not self._reached_by_backward:
            return
        self._reached_by_backward = False
        if self.engine is not None:
            self.engine.finish_backward()
        if self._forwards_awaiting_backward <= 0:
            self.close_step()

    def close_step(self) -> None:
        """Free what the step gathered (the root unit at stage 3); nothing if no step is open."""
        if self._step_open and self.engine is not None:
            self.engine.end_step()
        self._step_open = self._evaluating = False
        self._forwards_awaiting_backward = 0

    @contextmanager
    def gradients_accumulating(self) -> Iterator[None]:
        """Fabric's ``no_backward_sync``: micro-batches that accumulate without stepping."""
        engine = self.ensure_engine()
        if engine is None:
            yield
            return
        engine.sync_gradients = False
        try:
            yield
        finally:
            engine.sync_gradients = True

    def release(self) -> None:
        """Training is over: plain full parameters on the module's device again, hooks removed."""
        self.close_step()
        self._hooks.remove()
        if self.engine is not None:
            self.engine.release_parameters(self._device)
            self.engine = None


class ShardedModules:
    """The modules set up with one strategy, found by module or by optimizer."""

    def __init__(self) -> None:
        self._modules: list[ShardedModule] = []

    def __iter__(self) -> Iterator[ShardedModule]:
        return iter(self._modules)

    def add(self, sharded: ShardedModule) -> None:
        self._modules.append(sharded)

    def of(self, module: Optional[nn.Module]) -> Optional[ShardedModule]:
        return next((m for m in self._modules if m.module is module), None)

    def is_set_up(self, module: nn.Module) -> bool:
        return self.of(module) is not None

    def owner_of(self, optimizer: Optimizer) -> Optional[ShardedModule]:
        return next((m for m in self._modules if m.owns(optimizer)), None)

    def owner_module(self, optimizer: Optimizer) -> Optional[nn.Module]:
        owner = self.owner_of(optimizer)
        return owner.module if owner is not None else None

    def selected(self, module: Optional[nn.Module]) -> list[ShardedModule]:
        """``module``'s (given as set up, or as Fabric's wrapper), or all of them for None."""
        if module is None:
            return list(self._modules)
        sharded = self.of(_unwrap_objects(module))
        if sharded is None:
            raise ValueError(f"{type(module).__name__} was not set up with this strategy.")
        return [sharded]

    def close_steps(self) -> None:
        for sharded in self._modules:
            sharded.close_step()

    def release(self) -> None:
        for sharded in self._modules:
            sharded.release()
        self._modules.clear()


class AccumulateWithoutSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate without being reduced (stage 1) or
    are reduce-scattered into the shards at every backward (stages 2-3, where full gradients are
    not kept), as ``Trainer(accumulate_grad_batches=...)`` does under ``ZeroStrategy``."""

    def __init__(self, modules: ShardedModules) -> None:
        self._modules = modules

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        sharded = self._modules.of(module)
        if sharded is None:
            raise TypeError(f"`no_backward_sync` needs a module set up with lightning-zero; got {type(module).__name__}.")
        return sharded.gradients_accumulating()

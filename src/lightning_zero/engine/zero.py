"""The ZeRO engine: a module and its optimizers, with stages composed from the shared parts.

Stage 1 = sharded optimizer (``sharded_optimizer``) + buckets reduced after backward;
stage 2 = the same + buckets reduced during backward (``grad_sync``). Nothing here imports
Lightning: the strategy calls these methods from its hooks, and a Fabric strategy or a plain
training loop can call them the same way::

    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2))
    loss.backward(); engine.finish_backward()
    optimizer.step(); engine.after_optimizer_step(optimizer); optimizer.zero_grad()
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine import collectives
from lightning_zero.engine.bucket import Bucket, PendingParamGather, assign_buckets
from lightning_zero.engine.config import ZeroConfig, ZeroStage
from lightning_zero.engine.grad_sync import GradientSync, ReduceAfterBackward, ReduceDuringBackward
from lightning_zero.engine.sharded_optimizer import (
    check_optimizer,
    gather_full_state_dict,
    load_full_state_dict,
    rebind_param_groups,
)
from lightning_zero.engine.sharded_param import ShardedParam


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state this rank holds right now, by kind."""

    parameters: int
    """The module's parameters as they are now (full tensors at stages 1 and 2)."""
    gradients: int
    """Full-size ``param.grad`` tensors plus this rank's gradient shards."""
    optimizer_state: int
    """Optimizer state tensors plus fp32 master copies, both for this rank's shards only."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


class ZeroEngine:
    """Shards ``optimizers``' state (and, from stage 2, gradients) over the ranks of ``group``."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        config: ZeroConfig,
        group: collectives.ProcessGroup = None,
    ) -> None:
        if config.zero_stage is ZeroStage.PARAMETERS:
            raise ValueError("ZeroEngine implements stages 1 and 2; stage 3 shards parameters and is built separately.")
        self.config = config
        self.group = group
        self.rank = collectives.rank(group)
        self.world_size = collectives.world_size(group)
        self.optimizers = list(optimizers)
        optimizer_of = _optimizer_index_of_params(module, self.optimizers)

        self.params = [
            ShardedParam(name, p, self.rank, self.world_size)
            for name, p in module.named_parameters()
            if id(p) in optimizer_of
        ]
        sharded = {id(sp.param): sp for sp in self.params}
        self._params_of_optimizer = [rebind_param_groups(opt, sharded) for opt in self.optimizers]

        # gradients arrive roughly in reverse registration order, so buckets are filled that way
        trainable = [sp for sp in reversed(self.params) if sp.param.requires_grad]
        self.buckets = assign_buckets(
            trainable, {id(sp): optimizer_of[id(sp.param)] for sp in trainable}, config.bucket_bytes, group
        )
        self._buckets_of_optimizer: dict[int, list[Bucket]] = {id(opt): [] for opt in self.optimizers}
        for bucket in self.buckets:
            owner = self.optimizers[optimizer_of[id(bucket.params[0].param)]]
            self._buckets_of_optimizer[id(owner)].append(bucket)

        self.grad_sync: GradientSync = (
            ReduceAfterBackward(self.buckets)
            if config.zero_stage is ZeroStage.OPTIMIZER_STATE
            else ReduceDuringBackward(self.buckets)
        )
        self.sync_gradients = True
        """False while micro-batches only accumulate (Lightning's ``block_backward_sync``)."""

    # ---- the training step -----------------------------------------------------------------
    def begin_step(self) -> None:
        """Before each training/evaluation step (stage 3 gathers the root unit here)."""

    def end_step(self) -> None:
        """After each step, once its last backward finished (stage 3 frees the root unit)."""

    def finish_backward(self) -> None:
        """After every backward: the gradient shards are ready when this returns (unless
        ``sync_gradients`` is False at stage 1, where gradients keep accumulating unreduced)."""
        self.grad_sync.finish_backward(self.sync_gradients)

    def after_optimizer_step(self, optimizer: Optimizer, max_in_flight: int = 2) -> None:
        """All-gather the shards ``optimizer`` just updated back into the full parameters."""
        buckets = self._buckets_of(optimizer)
        in_flight: deque[PendingParamGather] = deque()
        for bucket in buckets:
            for p in bucket.params:
                p.check_storage_unchanged()
            in_flight.append(bucket.start_param_gather())
            if len(in_flight) >= max_in_flight:
                in_flight.popleft().finish()
        while in_flight:
            in_flight.popleft().finish()

    # ---- state -----------------------------------------------------------------------------
    def full_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as if unsharded; a collective, call on every rank."""
        return gather_full_state_dict(optimizer, self._params_of(optimizer), self.group)

    def load_full_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        load_full_state_dict(optimizer, state_dict, self._params_of(optimizer))

    def sync_master_weights(self) -> None:
        """Refresh fp32 master shards after the module's weights were loaded or edited."""
        for p in self.params:
            p.sync_master_from_param()

    def memory_report(self) -> MemoryReport:
        module_params = {id(p.param): p.param for p in self.params}
        parameters = sum(p.numel() * p.element_size() for p in module_params.values())
        gradients = sum(
            t.numel() * t.element_size()
            for sp in self.params
            for t in (sp.param.grad, sp.shard.grad)
            if t is not None
        )
        optimizer_state = sum(
            sp.optimizer_state_bytes(opt.state.get(sp.shard))
            for opt, params in zip(self.optimizers, self._params_of_optimizer)
            for sp in params
        )
        masters = sum(sp.shard.numel() * sp.shard.element_size() for sp in self.params if sp.holds_master_copy)
        return MemoryReport(parameters, gradients, optimizer_state + masters)

    def close(self) -> None:
        """Remove every hook; the module is left as a plain module with full parameters."""
        self.grad_sync.close()

    # ---- helpers ---------------------------------------------------------------------------
    def _index_of(self, optimizer: Optimizer) -> int:
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer:
                return i
        raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this engine shards.")

    def _params_of(self, optimizer: Optimizer) -> list[ShardedParam]:
        return self._params_of_optimizer[self._index_of(optimizer)]

    def _buckets_of(self, optimizer: Optimizer) -> list[Bucket]:
        return self._buckets_of_optimizer[id(self.optimizers[self._index_of(optimizer)])]


def _optimizer_index_of_params(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[int, int]:
    """Map ``id(param)`` to the index of the optimizer that holds it, checking that optimizers hold
    only the module's parameters, each at most once, and that something is trainable."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter with `requires_grad=True`: there is nothing to"
            " train or shard. Unfreeze at least one parameter, or run `trainer.validate/test/predict`."
        )
    names = {id(p): name for name, p in module.named_parameters()}
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        check_optimizer(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is"
                        " not a parameter of the module; lightning-zero can only shard the module's"
                        " own parameters. Build the optimizer from `self.parameters()` (or a subset)."
                    )
                if id(p) in owner:
                    raise ValueError(
                        f"Parameter {names[id(p)]!r} is held by two optimizers (#{owner[id(p)]} and"
                        f" #{index}); each parameter may be stepped by one optimizer only."
                    )
                owner[id(p)] = index
    return owner

"""The optimizers an engine shards, each rebound to this rank's chunks.

Binding one (``ShardedOptimizers.add``) points its param groups at the shards
(``optimizer/sharded_optimizer.py``), makes gradients assigned to ``param.grad`` reach the shards
before each of its steps (``gradients/grad_window.py``), switches it to torch's fused host kernel
under CPU offload (``optimizer/host_step.py``) and, with NVMe offload, moves its state to files
(``offload/disk_tier.py``). ``clear`` undoes all of it, so a new ``fit`` can bring new optimizers.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.offload.disk_tier import DiskTier, GradientBucket
from lightning_zero.engine.optimizer.host_step import FusedHostStep, fuse_host_steps
from lightning_zero.engine.optimizer.sharded_optimizer import rebind_param_groups
from lightning_zero.engine.parameters.residency import HOST
from lightning_zero.engine.shards.sharded_param import ShardedParam


class ShardedOptimizers:
    """``optimizers`` in the order they were added, and the sharded parameters each steps.

    ``before_step`` runs before every step of each (it takes the gradients assigned to
    ``param.grad``); ``disk`` and ``buckets``: the NVMe tier and the gradient buckets its files follow.
    """

    def __init__(
        self,
        params: Sequence[ShardedParam],
        config: ZeroConfig,
        before_step: Callable[[], None],
        disk: Optional[DiskTier],
        buckets: Sequence[GradientBucket],
    ) -> None:
        self._sharded = {id(sp.param): sp for sp in params}
        self._config = config
        self._before_step = before_step
        self._disk = disk
        self._buckets = buckets
        self.optimizers: list[Optimizer] = []
        self._params_of: list[list[ShardedParam]] = []
        self._step_hooks: list[RemovableHandle] = []
        self._fused_host_steps: list[FusedHostStep] = []

    def __contains__(self, optimizer: Optimizer) -> bool:
        return any(opt is optimizer for opt in self.optimizers)

    def add(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at the shards (offloaded: with the fused host step);
        gradients assigned to ``param.grad`` reach the shards before it steps."""
        self.optimizers.append(optimizer)
        self._params_of.append(rebind_param_groups(optimizer, self._sharded))
        self._step_hooks.append(optimizer.register_step_pre_hook(lambda *_: self._before_step()))
        if self._config.offload_optimizer and self._config.fused_host_step:
            self._fused_host_steps.extend(fuse_host_steps([optimizer], HOST))
        if self._disk is not None:
            self._disk.attach(optimizer, self._params_of[-1], self._buckets)

    def params_of(self, optimizer: Optimizer) -> list[ShardedParam]:
        """The sharded parameters `optimizer` steps, in its `state_dict` order."""
        for opt, params in zip(self.optimizers, self._params_of):
            if opt is optimizer:
                return params
        raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this engine shards.")

    def with_params(self) -> list[tuple[Optimizer, list[ShardedParam]]]:
        """Each optimizer with the sharded parameters it steps."""
        return list(zip(self.optimizers, self._params_of))

    def clear(self) -> None:
        """Unbind every optimizer (a new ``fit`` brings its own): their fused host steps and hooks go,
        and with NVMe offload each gets its own ``step`` back."""
        self.close_fused_host_steps()
        self.remove_step_hooks()
        if self._disk is not None:
            self._disk.detach_all()
        self.optimizers, self._params_of = [], []

    def remove_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    def close_fused_host_steps(self) -> None:
        """The optimizers step with their configured kernels again."""
        for step in self._fused_host_steps:
            step.close()
        self._fused_host_steps = []

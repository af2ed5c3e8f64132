"""The optimizers an engine shards, each rebound to this rank's chunks.

Binding one (``ShardedOptimizers.add``) points its param groups at the shards
(``optimizer/sharded_optimizer.py``), makes gradients assigned to ``param.grad`` reach the shards
before each of its steps (``gradients/grad_window.py``), switches it to torch's fused host kernel
under CPU offload (``optimizer/host_step.py``) and, with NVMe offload, moves its state to files
(``offload/disk_tier.py``). A whole-tensor optimizer (Muon, Adafactor, an unknown class) steps each
parameter whole on an owner rank instead (``optimizer/whole_tensor_step.py``; see [Note: step
granularity] in ``optimizer/optimizer_kinds.py``). An optimizer's ``train()``/``eval()`` that move the
weights (schedule-free optimizers), and its ``zero_grad``, reach the module
(``optimizer/weight_swaps.py``). ``clear`` undoes
all of it, so a new ``fit`` can bring new optimizers.

Checkpoints read and write an optimizer's state as the chunk path holds it (``chunked_state`` /
``load_chunked_state``), whichever way it steps.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.offload.disk_tier import DiskTier, GradientBucket
from lightning_zero.engine.optimizer.host_step import FusedHostStep, fuse_host_steps
from lightning_zero.engine.optimizer.optimizer_kinds import StepGranularity, step_granularity
from lightning_zero.engine.optimizer.sharded_optimizer import check_full_state_dict, chunked_entries, load_full_state_dict, rebind_param_groups
from lightning_zero.engine.optimizer.weight_swaps import WeightSwaps
from lightning_zero.engine.optimizer.whole_tensor_step import ChunkedState, WholeTensorStep
from lightning_zero.engine.parameters.residency import HOST
from lightning_zero.engine.shards.sharded_param import ShardedParam


class ShardedOptimizers:
    """``optimizers`` in the order they were added, and the sharded parameters each steps.

    ``before_step`` runs before every step of each (it takes the gradients assigned to
    ``param.grad``); ``disk`` and ``buckets``: the NVMe tier and the gradient buckets its files follow;
    ``group`` and ``compute_device``: where whole-tensor optimizers' owners exchange tensors;
    ``refresh(optimizer)`` makes the module see the chunks ``optimizer`` changed outside a step;
    ``reduced()``: the ``id``s of the parameters the last reduction gave a gradient (on every rank
    alike), which decide which take part in a whole-tensor step (None: no reduction to go by).
    ``after_zero_grad`` runs after any of them freed or zeroed its gradients (``zero_grad``).
    """

    def __init__(
        self,
        params: Sequence[ShardedParam],
        config: ZeroConfig,
        before_step: Callable[[], None],
        disk: Optional[DiskTier],
        buckets: Sequence[GradientBucket],
        group: collectives.ProcessGroup,
        compute_device: torch.device,
        refresh: Callable[[Optimizer], None],
        reduced: Callable[[], Optional[frozenset[int]]] = lambda: None,
        after_zero_grad: Callable[[], None] = lambda: None,
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
        self._group = group
        self._compute_device = compute_device
        self._refresh = refresh
        self._reduced = reduced
        self._after_zero_grad = after_zero_grad
        self._whole: dict[int, WholeTensorStep] = {}
        """The whole-tensor optimizers' steps, by ``id`` of the optimizer (kept after hooks go, for checkpoints)."""
        self._swaps: list[WeightSwaps] = []

    def __contains__(self, optimizer: Optimizer) -> bool:
        return any(opt is optimizer for opt in self.optimizers)

    def add(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at the shards (offloaded: with the fused host step);
        gradients assigned to ``param.grad`` reach the shards before it steps."""
        granularity = step_granularity(optimizer, self._config.elementwise_optimizers)
        if granularity is StepGranularity.WHOLE_TENSORS and self._disk is not None:
            raise ValueError(
                f"{type(optimizer).__name__} steps whole tensors (see docs/optimizers.md), which"
                " `offload_optimizer='nvme'` does not stream yet. Use `offload_optimizer=True` (host memory),"
                " or declare it element-wise with `elementwise_optimizers` if its update is."
            )
        params = rebind_param_groups(optimizer, self._sharded)
        self.optimizers.append(optimizer)
        self._params_of.append(params)
        self._step_hooks.append(optimizer.register_step_pre_hook(lambda *_: self._before_step()))
        whole = None
        if granularity is StepGranularity.WHOLE_TENSORS:
            whole = self._whole[id(optimizer)] = WholeTensorStep(optimizer, params, self._group, self._compute_device, self._reduced)
        elif self._config.offload_optimizer and self._config.fused_host_step:
            self._fused_host_steps.extend(fuse_host_steps([optimizer], HOST))
        if self._disk is not None:
            self._disk.attach(optimizer, params, self._buckets)
        self._swaps.append(
            WeightSwaps(optimizer, lambda: self._refresh(optimizer), whole.whole_weights if whole else nullcontext, self._after_zero_grad)
        )

    # ---- state, as the chunk path holds it ---------------------------------------------------
    def chunked_state(self, optimizer: Optimizer) -> ChunkedState:
        """``optimizer``'s ``state_dict`` in this rank's chunks (a collective for whole-tensor ones)."""
        state_dict = optimizer.state_dict()
        whole = self._whole.get(id(optimizer))
        if whole is not None:
            return whole.chunk_state(state_dict)
        return ChunkedState(state_dict, chunked_entries(state_dict, self.params_of(optimizer)))

    def load_chunked_state(self, optimizer: Optimizer, state_dict: dict[str, Any], chunked: frozenset[tuple[int, str]]) -> None:
        """The inverse of ``chunked_state`` (a collective for whole-tensor optimizers)."""
        whole = self._whole.get(id(optimizer))
        optimizer.load_state_dict(whole.load_chunk_state(state_dict, chunked) if whole is not None else state_dict)

    def load_full_state(self, optimizer: Optimizer, full_state_dict: dict[str, Any]) -> None:
        """Load an unsharded (DDP-format) ``state_dict``: this rank's chunks, or its owned tensors' state."""
        whole = self._whole.get(id(optimizer))
        if whole is None:
            load_full_state_dict(optimizer, full_state_dict, self.params_of(optimizer))
            return
        check_full_state_dict(full_state_dict, self.params_of(optimizer))
        optimizer.load_state_dict(whole.owners_part(full_state_dict))

    def steps_whole_tensors(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps whole tensors on owner ranks (``whole_tensor_step.py``)."""
        return id(optimizer) in self._whole

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
        self.optimizers, self._params_of, self._whole = [], [], {}

    def remove_step_hooks(self) -> None:
        """The optimizers step (and ``train()``/``eval()``) as configured, on whatever they hold now."""
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        for whole in self._whole.values():
            whole.close()
        for swaps in self._swaps:
            swaps.close()
        self._swaps = []

    def close_fused_host_steps(self) -> None:
        """The optimizers step with their configured kernels again."""
        for step in self._fused_host_steps:
            step.close()
        self._fused_host_steps = []

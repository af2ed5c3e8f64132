"""``ZeroGradScaler``: loss scaling (``16-mixed``) whose skip decision is taken across the ranks, and
which unscales gradients that live on the host without racing their copies.

Each rank unscales only its gradient shard, so a plain ``GradScaler`` finds inf/NaN per shard and
the ranks would skip different steps and let their scales diverge. Both adapters (the Trainer's
precision plugins and the Fabric strategy) put this scaler in place of Lightning's.

[Note: the scaler and host gradients]
With offload the gradient shards live on the host and the scale on the device. torch's
``GradScaler._unscale_grads_`` copies the scale's inverse and a zero inf flag to each gradient's
device with ``non_blocking=True``: to the host, a copy into pinned memory that the CPU kernel reads
at once, before it landed, and that lands afterwards, overwriting the inf the kernel found. An
overflow step is then not skipped (inf/NaN reach the fp32 masters and the scale never backs off), or
the gradients are unscaled by a stale factor. torch fixed the same race for FSDP's CPU offload in
FSDP's own scaler. Here:

- ``_unscale_grads_`` copies the two scalars to each device with blocking copies (on the host: one
  host sync per step, which an offloaded step makes anyway before stepping there) and returns one
  verdict, on the scale's device, reduced across the ranks;
- where the host step runs during backward (``engine/offload/step_ahead.py``), each bucket's
  gradients were unscaled there, on the worker, by the same factor and kernel: ``_unscale_grads_``
  takes their verdict instead of unscaling twice, and a step it skips is undone;
- an optimizer stepping host tensors never takes the path that hands a fused optimizer the
  device's ``grad_scale`` and ``found_inf`` (``_step_supports_amp_scaling``), which its CPU kernel
  would read the same way: it is unscaled first and stepped unless a rank found inf/NaN, as
  ``GradScaler`` steps every other optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.device_roles import is_host
from lightning_zero.engine.offload.step_ahead import step_ahead_of


class ZeroGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/NaN verdict is taken across all ranks (each sees only its shard),
    so every rank skips the same steps and the scales never diverge; safe with gradients on the host
    (see [Note: the scaler and host gradients])."""

    def __init__(self, *args: Any, group: collectives.ProcessGroup = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler) -> "ZeroGradScaler":
        """The same settings and current state as ``scaler``."""
        if not scaler.is_enabled():  # e.g. a CUDA scaler built where CUDA is missing: it keeps no settings
            return cls(scaler._device, enabled=False)
        converted = cls(
            scaler._device,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler._enabled,
        )
        if scaler._scale is not None:
            converted.load_state_dict(scaler.state_dict())
        return converted

    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        flag = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        ahead = step_ahead_of(optimizer)
        found_ahead = ahead.unscaled_ahead(inv_scale) if ahead is not None else None
        if found_ahead is not None:  # unscaled bucket by bucket during backward (step_ahead.py)
            flag.fill_(found_ahead)
            collectives.all_reduce(flag, self.group, op="max")
            return {flag.device: flag}
        with torch.no_grad():
            for device, same_kinds in _grads_by_device_and_dtype(optimizer, allow_fp16).items():
                # blocking where ``device`` is the host; the same tensors where it is the scale's
                inv_here, found_here = torch.stack((inv_scale, found_inf)).to(device).unbind()
                for grads in same_kinds:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_here)
                    for grad in grads:  # the kernel moves no version counter; a step taken before it must see the edit
                        torch.autograd.graph.increment_version(grad)
                flag += found_here.to(flag.device)
        # one flag, reduced once: a rank whose shard has no gradient on some device must still
        # take part, so the collective count may not depend on the devices
        collectives.all_reduce(flag, self.group, op="max")
        return {flag.device: flag}

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        stepped = self._step(optimizer, *args, **kwargs)
        ahead = step_ahead_of(optimizer)
        if ahead is not None:  # a step skipped for inf/NaN: what was stepped during backward is undone
            ahead.settle("inf or NaN gradients: loss scaling skipped the step")
        return stepped

    def _step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not (self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False) and self._on_host(optimizer)):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        stepped = self._maybe_opt_step(optimizer, state, *args, **kwargs)  # reads the verdict on the host
        state["stage"] = OptState.STEPPED
        return stepped

    def _on_host(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps host tensors (offloaded shards) while the scale is on a device."""
        scale_device = self._scale.device if self._scale is not None else torch.device(self._device)
        return any(p.device != scale_device or is_host(p) for group in optimizer.param_groups for p in group["params"])


def _grads_by_device_and_dtype(optimizer: Optimizer, allow_fp16: bool) -> dict[torch.device, list[list[torch.Tensor]]]:
    """The optimizer's gradients in lists of one device and dtype (what one foreach kernel takes); the
    engine's gradient chunks are dense, so unlike torch's this takes no sparse gradient."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            groups.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
    return {device: list(by_dtype.values()) for device, by_dtype in groups.items()}

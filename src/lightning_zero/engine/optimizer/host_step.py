"""The offloaded optimizer step on the host: the optimizer's own kernel, or torch's fused CPU kernel.

With CPU offload the optimizer steps host chunks. ``ZeroConfig(fused_host_step=True)`` switches an
offloaded optimizer that has a fused CPU kernel (Adam, AdamW, SGD, Adagrad) to ``fused=True`` (and
``foreach=False``) before its first step; by default it keeps the kernel the user configured.

[Note: the exact host step]
The fused kernel does the update in one multithreaded pass per group; the kernel a plain
``AdamW()`` runs on CPU tensors (the per-tensor loop; ``foreach=True`` does the same arithmetic one
op at a time over the list) makes one pass per operation. On the 2-core CPU
(``scripts/fused_host_step.py``, 2026-12-07) the fused step of one rank's chunks was 3.9x faster for
the bench's GPT (one thread) and 2.4x for the 1.2B GPT's chunks over 8 ranks (two threads).

But the fused kernel rounds differently (it does not compute Adam's moments with ``lerp``), and
training carries a one-step difference on through the gradients: on the bench's GPT, 7e-9 after one
step, 1e-5 after 10 and 30 (AdamW, lr 1e-3); issue 62 saw 2.8e-4 on a ViT-tiny after 10 steps. The
one promise is DDP's numerics, and a speed feature is judged first by whether it keeps DDP's bits,
so the fused kernel is the user's choice, not the default: with the configured kernel offloaded runs
equal non-offloaded ones bitwise (tested on the CPU, where DDP runs the same kernel).

The switch is the engine's, not the user's: ``state_dict()`` reports the groups' ``fused`` and
``foreach`` as the user configured them (so a checkpoint loads elsewhere with the user's kernel),
and ``load_state_dict()`` switches them again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

KERNEL_KEYS = ("fused", "foreach")
"""Param-group entries that choose the kernel, not the arithmetic."""


def has_fused_cpu_kernel(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s class takes ``fused=True`` for CPU tensors in this torch."""
    if "fused" not in optimizer.defaults or any(group.get("differentiable") for group in optimizer.param_groups):
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - very old torch
        return False
    return "cpu" in _get_fused_kernels_supported_devices()


class FusedHostStep:
    """Switches one offloaded optimizer to its fused CPU kernel, and keeps it switched across
    ``load_state_dict`` while its ``state_dict`` reports the user's own choice."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._configured = [{key: group.get(key) for key in KERNEL_KEYS} for group in optimizer.param_groups]
        self._handles: list[RemovableHandle] = [
            optimizer.register_state_dict_post_hook(self._report_configured_kernel),
            optimizer.register_load_state_dict_post_hook(lambda _: self.switch()),
        ]
        self.switch()

    def switch(self) -> None:
        for group in self.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False

    def _report_configured_kernel(self, _: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        for group, configured in zip(state_dict["param_groups"], self._configured):
            group.update(configured)
        return state_dict

    def close(self) -> None:
        """Give the optimizer back its configured kernel."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group, configured in zip(self.optimizer.param_groups, self._configured):
            group.update(configured)


def fuse_host_steps(optimizers: list[Optimizer], host: torch.device) -> list[FusedHostStep]:
    """A ``FusedHostStep`` for each of ``optimizers`` whose parameters all live on ``host`` and
    that has a fused CPU kernel; the others keep theirs."""
    return [
        FusedHostStep(optimizer)
        for optimizer in optimizers
        if optimizer.param_groups
        and has_fused_cpu_kernel(optimizer)
        and all(p.device == host for group in optimizer.param_groups for p in group["params"])
    ]

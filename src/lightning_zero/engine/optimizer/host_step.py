"""The offloaded optimizer step: torch's fused CPU kernel where the optimizer has one.

With CPU offload the optimizer steps host chunks, and for that torch's default path (a Python loop
over tensors, or ``foreach`` kernels that run one small op at a time) is 10-35x slower than its
fused CPU kernel, which updates a whole group in one multithreaded pass. So when every group of an
offloaded optimizer steps host tensors and the optimizer has a fused CPU kernel (Adam, AdamW, SGD,
Adagrad), its groups are switched to ``fused=True`` (and ``foreach=False``) before its first step.
``ZeroConfig(fused_host_step=False)`` keeps the kernel the user configured.

Parity: the fused kernel does the same arithmetic in another order, so offloaded runs match
non-offloaded ones to float rounding (≤ 1e-6 here), not bitwise; offloaded runs are bitwise
reproducible among themselves.

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

"""Gradient norms computed ahead, where a chunk's gradient landed: the host step during backward
computes each offloaded bucket's per-tensor norms on its worker thread (see [Note: the host step
during backward] in ``offload/step_ahead.py``), so that clipping by norm after backward does not read
every host gradient again on the critical path.

A norm is remembered for a parameter (the optimizer's shard) together with the gradient tensor it
was computed from and that tensor's version counter; it is used only while the parameter still has
that very gradient, unedited, and for the same norm type. It is computed by ``norms_of``, the one
function that computes such norms, on the same tensor: the same bits as computing it later.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from torch import Tensor

_REMEMBERED: dict[int, tuple[weakref.ref, weakref.ref, int, float, Tensor]] = {}
"""By ``id`` of the parameter (tensors compare element-wise, so they cannot be dictionary keys): the
parameter and its gradient (weakly), the gradient's version, the norm type and the norm."""


def group_by_dtype_and_device(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """``tensors`` in lists of one dtype and device each (what one foreach kernel takes)."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def norms_of(tensors: Sequence[Tensor], norm_type: float = 2.0) -> list[Tensor]:
    """Each tensor's fp32 ``norm_type``-norm, in ``tensors``' order: one foreach kernel per dtype and
    device where torch has it (torch 2.4's ``_foreach_norm`` may lack ``dtype``). An empty tensor's
    norm is 0, also for the max-norm."""
    norms: dict[int, Tensor] = {}
    for same_kind in group_by_dtype_and_device([t for t in tensors if t.numel()]):
        try:
            computed = torch._foreach_norm(same_kind, norm_type, dtype=torch.float32)
        except (TypeError, RuntimeError):
            computed = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in same_kind]
        norms.update((id(t), n) for t, n in zip(same_kind, computed))
    zero = torch.zeros((), dtype=torch.float32, device=tensors[0].device) if tensors else None
    return [norms.get(id(t), zero) for t in tensors]


def remember_grad_norms(params: Sequence[Tensor], norm_type: float = 2.0) -> None:
    """Compute and remember the norm of each of ``params``' gradients (those that have one)."""
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad.detach() for p in with_grad]
    for p, grad, norm in zip(with_grad, grads, norms_of(grads, norm_type) if grads else ()):
        _REMEMBERED[id(p)] = (weakref.ref(p), weakref.ref(p.grad), p.grad._version, float(norm_type), norm)


def remembered_grad_norm(param: Tensor, norm_type: float) -> Optional[Tensor]:
    """The norm remembered for ``param``'s gradient as it is now, if any."""
    entry = _REMEMBERED.get(id(param))
    if entry is None:
        return None
    param_ref, grad_ref, version, remembered_type, norm = entry
    grad = param.grad
    if param_ref() is not param or grad is None or grad_ref() is not grad or grad._version != version:
        return None
    return norm if remembered_type == float(norm_type) else None

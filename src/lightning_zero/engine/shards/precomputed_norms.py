"""Gradient norms computed ahead, where a chunk's gradient landed: the host step during backward
computes each offloaded bucket's per-tensor norms on its worker thread (see [Note: the host step
during backward] in ``offload/step_ahead.py``), so that clipping by norm after backward does not read
every host gradient again on the critical path.

A norm is remembered for a parameter (the optimizer's shard) together with the gradient tensor it
was computed from and that tensor's version counter, read before the norm is computed (an edit racing
the computation moves it, so a stale norm is never paired with the new version). It is used only
while the parameter still has that very gradient, unedited, and for the same norm type; where edits
may move no version counter (``.data``, a NumPy view), the caller also gives ``still_valid``, which
compares the gradients' contents with a digest taken before the norm (see [Note: gradient digests]
in ``offload/grad_digest.py``). It is computed by ``norms_of``, the one function that computes such
norms, on the same tensor: the same bits as computing it later.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

@dataclass(frozen=True)
class _Remembered:
    param: weakref.ref
    grad: weakref.ref
    version: int
    norm_type: float
    norm: Tensor
    still_valid: Optional[Callable[[], bool]]


_REMEMBERED: dict[int, _Remembered] = {}
"""By ``id`` of the parameter (tensors compare element-wise, so they cannot be dictionary keys)."""


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


def remember_grad_norms(params: Sequence[Tensor], norm_type: float = 2.0, still_valid: Optional[Callable[[], bool]] = None) -> None:
    """Compute and remember the norm of each of ``params``' gradients (those that have one).
    ``still_valid``: whether the gradients still hold what the norms read (asked once per lookup
    of a group of norms, see ``remembered_grad_norms``); None: their version counters tell."""
    taken = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]  # versions before the norms
    norms = norms_of([grad.detach() for _, grad, _ in taken], norm_type) if taken else []
    for (p, grad, version), norm in zip(taken, norms):
        _REMEMBERED[id(p)] = _Remembered(weakref.ref(p), weakref.ref(grad), version, float(norm_type), norm, still_valid)


def remembered_grad_norms(params: Sequence[Tensor], norm_type: float) -> list[Optional[Tensor]]:
    """For each of ``params``, the norm remembered for its gradient as it is now, if any; each
    ``still_valid`` among them is asked once."""
    asked: dict[int, bool] = {}
    found: list[Optional[Tensor]] = []
    for param in params:
        entry = _REMEMBERED.get(id(param))
        grad = param.grad
        if (
            entry is None
            or entry.param() is not param
            or grad is None
            or entry.grad() is not grad
            or grad._version != entry.version
            or entry.norm_type != float(norm_type)
        ):
            found.append(None)
            continue
        check = entry.still_valid
        if check is not None and id(check) not in asked:
            asked[id(check)] = check()
        found.append(entry.norm if check is None or asked[id(check)] else None)
    return found

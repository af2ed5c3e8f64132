"""Gradient norms over shards: foreach kernels per dtype and device, one all-reduce.

Each rank holds a disjoint piece of every gradient (its chunk), so a global p-norm is the p-th root
of the all-reduced sum of the local p-th powers; a max-norm all-reduces the local maxima.

With offload the chunks' gradients live on the host: the local norms are computed there (where the
gradients are) and moved to the compute device before the all-reduce, since NCCL takes device
tensors only (see [Note: device roles] in ``device_roles.py``). So every function that reduces
takes the compute ``device``; its results are on it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shards.precomputed_norms import group_by_dtype_and_device, norms_of, remembered_grad_norms
from lightning_zero.engine.shards.sharded_param import ShardedParam


def stacked_norms(tensors: Sequence[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """(len(tensors),) fp32 on ``device``: each of ``tensors``' (at least one) norms, in order,
    computed where the tensor is and moved with one copy per device they are on."""
    return _stacked(norms_of(tensors, norm_type), device)


def _stacked(norms: Sequence[Tensor], device: torch.device) -> Tensor:
    """``norms`` (0-dim fp32, on any devices) as one (len(norms),) tensor on ``device``, one copy per device."""
    positions: dict[torch.device, list[int]] = {}
    for i, norm in enumerate(norms):
        positions.setdefault(norm.device, []).append(i)
    if len(positions) == 1:
        return torch.stack(norms).to(device)
    stacked = torch.empty(len(norms), dtype=torch.float32, device=device)
    for at in positions.values():
        stacked[torch.tensor(at, device=device)] = torch.stack([norms[i] for i in at]).to(device)
    return stacked


def global_grad_norm(
    parameters: Sequence[Tensor], group: collectives.ProcessGroup, device: torch.device, norm_type: float = 2.0
) -> Tensor:
    """The ``norm_type``-norm of all gradients across ranks, on ``device``, when each rank holds a
    disjoint shard of them (every element on exactly one rank); equal to ``clip_grad_norm_``'s norm
    over full gradients."""
    norm_type = float(norm_type)
    with_grad = [p for p in parameters if p.grad is not None]
    # norms the host step during backward computed already, for these very gradients (precomputed_norms.py)
    known = remembered_grad_norms(with_grad, norm_type)
    computed = iter(norms_of([p.grad.detach() for p, norm in zip(with_grad, known) if norm is None], norm_type))
    norms = [norm if norm is not None else next(computed) for norm in known]
    local = _stacked(norms, device) if norms else torch.zeros(1, device=device)
    if norm_type == float("inf"):
        return collectives.all_reduce(local.max().reshape(1), group, op="max").reshape(())
    if norm_type == 2.0:
        local_norm = torch.linalg.vector_norm(local)
        powered = (local_norm * local_norm).reshape(1)
    else:
        powered = local.pow(norm_type).sum().reshape(1)
    return collectives.all_reduce(powered, group, op="sum").pow(1.0 / norm_type).reshape(())


def clip_grads_by_global_norm_(
    parameters: Sequence[Tensor],
    max_norm: float,
    device: torch.device,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    group: collectives.ProcessGroup = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradient shards: the same formula, over the norm of the
    full gradients (one all-reduce on ``device``, the compute device). Returns that norm, before
    clipping, on ``device``."""
    total_norm = global_grad_norm(parameters, group, device, norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):  # a host sync, as in torch's
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite,"
            " so it cannot be clipped. To disable this error and scale the gradients by the non-finite"
            " norm anyway, set `error_if_nonfinite=False`."
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # non-finite norms propagate as in torch's
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    host_coef: Optional[Tensor] = None
    for same_kind in group_by_dtype_and_device(grads):  # one multiply kernel per dtype and device
        device = same_kind[0].device
        if device.type == "cpu":
            # gradients in host memory (offloaded, or training on the CPU): the coefficient comes to
            # the host anyway (a blocking copy from a device), and multiplying by exactly 1.0 changes
            # no bit, so it is skipped: gradients left as they are keep the step taken during
            # backward (see [Note: the host step during backward] in ``offload/step_ahead.py``)
            host_coef = clip_coef.to(device) if host_coef is None else host_coef
            if host_coef.item() == 1.0:
                continue
        torch._foreach_mul_(same_kind, clip_coef.to(device, same_kind[0].dtype))
    return total_norm


def global_norms(
    shards: Sequence[Tensor], norm_type: float, group: collectives.ProcessGroup, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Each full tensor's ``norm_type``-norm and the norm of all of them, on ``device``, from every
    rank's ``shards`` (the same list of tensors on every rank, each a disjoint chunk): one all-reduce."""
    local = stacked_norms(shards, norm_type, device)
    if norm_type == float("inf"):
        per_tensor = collectives.all_reduce(local, group, op="max")
        return per_tensor, per_tensor.max()
    powered = collectives.all_reduce(local.pow(norm_type), group, op="sum")
    return powered.pow(1.0 / norm_type), powered.sum().pow(1.0 / norm_type)


def norms_by_name(
    params: Sequence[ShardedParam], norm_type: float, group: collectives.ProcessGroup, device: torch.device
) -> dict[str, Tensor]:
    """``ZeroEngine.grad_norms``: each parameter's full-gradient norm by name, and ``"total"``, on
    ``device``, from the gradient chunks ``params`` hold (the same parameters have one on every rank)."""
    with_grad = [p for p in params if p.shard.grad is not None]  # the same on every rank
    if not with_grad:
        return {}
    per_param, total = global_norms([p.shard.grad.detach() for p in with_grad], norm_type, group, device)
    norms = {p.name: norm for p, norm in zip(with_grad, per_param)}
    norms["total"] = total
    return norms

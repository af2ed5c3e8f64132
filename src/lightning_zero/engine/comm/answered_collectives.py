"""Collectives that user code runs on tensors which answer them without communicating: an
``all_reduce`` on a sharded gradient, whose copies are the same full gradient on every rank (see
``gradients/sharded_grad.py``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

ALL_REDUCE_OP = torch.ops.c10d.allreduce_.default
"""What ``torch.distributed.all_reduce`` dispatches to (a tensor subclass sees it in ``__torch_dispatch__``)."""


def all_reduce_factor(args: tuple, kwargs: dict, device: torch.device) -> Optional[float]:
    """What an ``ALL_REDUCE_OP`` call, as ``__torch_dispatch__`` receives it (``args[0]`` its tensors), does
    to equal copies of a tensor on every rank of its group: multiply them by the factor returned (the
    group's size for ``SUM``, 1.0 for ``AVG``, ``MAX`` and ``MIN``), or None where the result is no
    multiple of them (``PRODUCT``). A collective, as the call is: the same operation over the same
    group, on a probe of two elements (its group and operation arrive as TorchScript objects, which
    torch releases before 2.7 give no way to read)."""
    probe = torch.tensor([1.0, 2.0], dtype=torch.float64, device=device)
    COLLECTIVE_STATS.record("all_reduce", probe)
    _, work = ALL_REDUCE_OP([probe], *args[1:], **kwargs)
    work.wait()
    one, two = probe.tolist()
    return one if two == 2 * one else None


def finished_work(tensors: list[Tensor]) -> Any:
    """A completed ``Work`` for a collective answered without communicating, in the form an operator
    returns it to ``torch.distributed`` (which waits on it, or hands it to the caller)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensors)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()

"""One bucket's step taken during backward, and what it read: the record the verdict at
``optimizer.step()`` compares with the present (see [Note: the host step during backward] in
``step_ahead.py``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.offload.host_chunks import HostChunks


@dataclass
class BucketStep:
    """A bucket queued or stepped ahead in this backward, and what its step read."""

    host: HostChunks
    index: int
    accepted: threading.Event = field(default_factory=threading.Event)
    future: Optional[Future] = None
    grads: list[tuple[Tensor, Optional[Tensor], int]] = field(default_factory=list)
    """Per shard of the optimizer in the bucket: (shard, its ``.grad`` as stepped, that grad's version)."""
    hyperparameters: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    master_version: int = -1
    found_inf: float = 0.0
    """With loss scaling: what unscaling its gradients found (non-zero: inf/NaN, not stepped)."""
    saved: bool = False
    """Its rollback copy holds the state before its step."""
    stepped: bool = False
    start: float = 0.0
    end: float = 0.0

    def what_changed(self, groups: Sequence[dict[str, Any]]) -> str:
        """Why this bucket's step is not the one stepping with ``groups`` now would take ("" if it
        is): a gradient replaced or edited in place (its version counter), a hyperparameter changed,
        or the master chunks written since."""
        for shard, grad, version in self.grads:
            if shard.grad is not grad or (grad is not None and grad._version != version):
                return "gradients changed after backward"
        for i, hyperparameters in self.hyperparameters:
            if i >= len(groups) or not _same(hyperparameters_of(groups[i]), hyperparameters):
                return "hyperparameters changed after backward"
        if self.host.master._version != self.master_version:
            return "weights written after backward"
        return ""


def hyperparameters_of(group: dict[str, Any], copy: bool = False) -> dict[str, Any]:
    """A param group's entries but its parameters (``copy``: tensor values cloned, since a scheduler
    may change them in place)."""
    return {key: value.clone() if copy and isinstance(value, Tensor) else value for key, value in group.items() if key != "params"}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two param groups' hyperparameters are equal (tensor values by their elements)."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, Tensor) or isinstance(other, Tensor):
            if not (isinstance(value, Tensor) and isinstance(other, Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True

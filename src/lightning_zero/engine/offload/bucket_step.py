"""One bucket's step taken during backward, and what it read: the record the verdict at
``optimizer.step()`` compares with the present (see [Note: the host step during backward] in
``step_ahead.py``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.offload.grad_digest import GradContents
from lightning_zero.engine.offload.host_chunks import HostChunks

GRADIENTS_CHANGED = "gradients changed after backward"
"""A gradient replaced, dropped or edited in place after the step read it (its version counter moved)."""
CONTENTS_CHANGED = "gradient contents changed after backward (an edit no version counter saw: `.data`, `.detach()`, a NumPy view)"
"""The content check saw it (see [Note: gradient digests] in ``grad_digest.py``)."""
HYPERPARAMETERS_CHANGED = "hyperparameters changed after backward"
WEIGHTS_WRITTEN = "weights written after backward"
CHUNKS_READ = "the chunks were read before the optimizer step"


@dataclass
class BucketStep:
    """A bucket queued or stepped ahead in this backward, and what its step read."""

    host: HostChunks
    index: int
    accepted: threading.Event = field(default_factory=threading.Event)
    future: Optional[Future] = None
    grads: list[tuple[Tensor, Optional[Tensor], int]] = field(default_factory=list)
    """Per shard of the optimizer in the bucket: (shard, its ``.grad`` as stepped, that grad's
    version, read before anything else read the gradient)."""
    contents: Optional[GradContents] = None
    """Where the verdict compares contents (user code ran between backward and the step): the
    gradients' digests as the step read them."""
    hyperparameters: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    weights_after: list[int] = field(default_factory=list)
    """The version counters of the master row and of each shard (they count apart: the shards are
    not autograd views of the row) after the step: a write since then moved them (torch's fused CPU
    kernels, which the step uses, move none themselves)."""
    found_inf: float = 0.0
    """With loss scaling: what unscaling its gradients found (non-zero: inf/NaN, not stepped)."""
    saved: bool = False
    """Its rollback copy holds the state before its step."""
    stepped: bool = False
    """The worker took its step."""
    undone: bool = False
    """Its step was rolled back since."""
    settled: bool = False
    """Its step was undone because the chunks were read before the verdict (``StepAhead._settle_bucket``):
    the verdict steps it after backward."""
    start: float = 0.0
    end: float = 0.0

    @property
    def holds_step(self) -> bool:
        """The master chunks and state hold this step (not committed, not undone)."""
        return self.stepped and not self.undone

    @property
    def shards(self) -> list[Tensor]:
        return [shard for shard, _, _ in self.grads]

    def weights_written(self) -> bool:
        """Whether the master chunks or the shards were written since the step (their version counters)."""
        return weight_versions(self.host, self.shards) != self.weights_after

    def what_changed(self, groups: Sequence[dict[str, Any]]) -> str:
        """Why this bucket's step is not the one stepping with ``groups`` now would take, as far as
        metadata tells ("" if it is): a gradient replaced or edited in place (its version counter),
        a hyperparameter changed."""
        for shard, grad, version in self.grads:
            if shard.grad is not grad or (grad is not None and grad._version != version):
                return GRADIENTS_CHANGED
        for i, hyperparameters in self.hyperparameters:
            if i >= len(groups) or not _same(hyperparameters_of(groups[i]), hyperparameters):
                return HYPERPARAMETERS_CHANGED
        return ""

    def contents_changed(self) -> str:
        """``CONTENTS_CHANGED`` where the gradients' contents differ from what the step read (an edit
        no version counter saw); "" where they do not, or where no digest was taken."""
        if self.contents is not None and not self.contents.unchanged([grad for _, grad, _ in self.grads]):
            return CONTENTS_CHANGED
        return ""


def weight_versions(host: HostChunks, shards: Sequence[Tensor]) -> list[int]:
    """The version counters of ``host``'s master row and of ``shards`` (its optimizer's views of it)."""
    return [host.master._version, *(shard._version for shard in shards)]


def hyperparameters_of(group: dict[str, Any], copy: bool = False) -> dict[str, Any]:
    """A param group's entries but its parameters (``copy``: a snapshot, tensors cloned and
    containers copied, since a scheduler or a hook may change them in place)."""
    return {key: _snapshot(value) if copy else value for key, value in group.items() if key != "params"}


def _snapshot(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, dict, set)) or (isinstance(value, tuple) and any(isinstance(v, (Tensor, list, dict)) for v in value)):
        return deepcopy(value)  # `betas` kept as a list and edited in place, tensors inside
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values (or dicts of them) are equal: tensors by their elements,
    containers element by element, anything else by ``==`` (a float NaN equal to itself)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:  # noqa: BLE001 - something that cannot say: not known to be the same
        return False

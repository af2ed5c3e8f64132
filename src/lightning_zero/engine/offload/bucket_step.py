"""One bucket's step taken during backward, and what it read: the record the verdict at
``optimizer.step()`` compares with the present (see [Note: the host step during backward] in
``step_ahead.py``).

The verdict runs on the critical path, once per bucket, so what it compares is kept as flat lists
taken once (the shards, their gradients, their version counters) and compared with one C-level op
each (``map`` over an ``operator`` function, list equality): no Python runs per parameter.
"""

from __future__ import annotations

import operator
import threading
from concurrent.futures import Future
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.offload.grad_digest import GradContents
from lightning_zero.engine.offload.host_chunks import HostChunks

if TYPE_CHECKING:
    from lightning_zero.engine.offload.rollback import RollbackCopy

GRADIENTS_CHANGED = "gradients changed after backward"
"""A gradient replaced, dropped or edited in place after the step read it (its version counter moved)."""
CONTENTS_CHANGED = "gradient contents changed after backward (an edit no version counter saw: `.data`, `.detach()`, a NumPy view)"
"""The content check saw it (see [Note: gradient digests] in ``grad_digest.py``)."""
HYPERPARAMETERS_CHANGED = "hyperparameters changed after backward"
WEIGHTS_WRITTEN = "weights written after backward"
CHUNKS_READ = "the chunks were read before the optimizer step"

GRAD = operator.attrgetter("grad")
VERSION = operator.attrgetter("_version")


class BucketStepping(Protocol):
    """How buckets step ahead where not as the CPU tier's (``offload_optimizer="nvme"``:
    ``disk_step_ahead.DiskStepping``)."""

    def step(self, source: Any, **step_kwargs: Any) -> None:
        """The update of ``source``'s parameters (the optimizer, or a view narrowed to some buckets)."""
        ...

    def rollback(self, host: HostChunks, shards: Sequence[Tensor]) -> "RollbackCopy":
        """What keeps a bucket's step undoable (made once per bucket, saved before each step)."""
        ...

    def arrived(self, host: HostChunks, shards: Sequence[Tensor]) -> None:
        """``host``'s gradients are landing, during backward (its step comes next)."""
        ...


@dataclass(eq=False)
class StepBatch:
    """The buckets one wake of the worker took (every bucket that had landed by then) and stepped in
    one call of the optimizer's update: one handoff, one ``accepted`` event, one snapshot of the
    hyperparameters for all of them."""

    jobs: list["BucketStep"] = field(default_factory=list)
    accepted: threading.Event = field(default_factory=threading.Event)
    """Set once every job's gradients were handed out (``HostChunks.accept`` waits for it)."""
    future: Optional[Future] = None
    hyperparameters: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(param group index, its hyperparameters as the step read them) of every group it stepped."""
    start: float = 0.0
    end: float = 0.0

    def hyperparameters_changed(self, groups: Sequence[dict[str, Any]]) -> bool:
        """Whether a param group the step read holds other hyperparameters now."""
        return any([i >= len(groups) or not same_hyperparameters(groups[i], taken) for i, taken in self.hyperparameters])


@dataclass(eq=False)
class BucketStep:
    """A bucket queued or stepped ahead in this backward, and what its step read."""

    host: HostChunks
    index: int
    shards: list[Tensor]
    """The optimizer's shards in the bucket."""
    batch: Optional[StepBatch] = None
    """The worker's wake that takes it (``step_worker.py``)."""
    grads: list[Optional[Tensor]] = field(default_factory=list)
    """Each shard's ``.grad`` as stepped (None: it had none), read before anything else read it."""
    held: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The gradients in ``grads`` that are not None, and their version counters as read."""
    contents: Optional[GradContents] = None
    """Where the verdict compares contents (user code ran between backward and the step): the
    gradients' digests as the step read them."""
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
    """Its step was undone, or called off before the worker took it, because the chunks were read
    before the verdict (``StepAhead._settle_bucket``): the verdict steps it after backward."""
    taken: bool = False
    """The worker has waited for its row and decided to step it: from then on, a read of its chunks
    waits for that step (which waits for nothing else)."""
    called_off: bool = False
    """A read of its chunks came before the worker took it: the worker leaves it to the verdict."""
    start: float = 0.0
    end: float = 0.0
    """Its share of its batch's step (apportioned by elements where the batch stepped several buckets)."""

    @property
    def future(self) -> Optional[Future]:
        return self.batch.future if self.batch is not None else None

    @property
    def holds_step(self) -> bool:
        """The master chunks and state hold this step (not committed, not undone)."""
        return self.stepped and not self.undone

    def read(self, grads: list[Optional[Tensor]]) -> None:
        """Record ``grads`` (the shards' ``.grad``) as the step is about to read them."""
        self.grads = grads
        self.held = [g for g in grads if g is not None]
        self.versions = list(map(VERSION, self.held))

    def weights_written(self) -> bool:
        """Whether the master chunks or the shards were written since the step (their version counters)."""
        return weight_versions(self.host, self.shards) != self.weights_after

    def gradients_changed(self) -> bool:
        """Whether a gradient the step read was replaced, dropped or edited in place since (its
        version counter: every edit through autograd's view of it, or through ``param.grad``)."""
        if not all(map(operator.is_, map(GRAD, self.shards), self.grads)):
            return True
        return list(map(VERSION, self.held)) != self.versions

    def contents_changed(self) -> str:
        """``CONTENTS_CHANGED`` where the gradients' contents differ from what the step read (an edit
        no version counter saw); "" where they do not, or where no digest was taken."""
        if self.contents is not None and not self.contents.unchanged(self.grads):
            return CONTENTS_CHANGED
        return ""


def no_rollback_error(why: str) -> RuntimeError:
    """A verdict failed (``why``) where no rollback copy was kept to undo the step taken ahead."""
    return RuntimeError(
        f"The optimizer step was taken during backward, and then {why}, so it is not the step"
        " to take; no rollback copies were kept because nothing was expected to change between"
        " backward and `optimizer.step()`. HINT: pass `ZeroStrategy(..., overlap_host_step=False)`"
        " (or report what changed them: the strategy keeps rollback copies where clipping or a"
        " hook between backward and the step is configured)."
    )


def weights_written_error() -> RuntimeError:
    """``WEIGHTS_WRITTEN``: no rollback can undo it."""
    return RuntimeError(
        "The optimizer's chunks (the weights it steps) were written between backward and"
        " `optimizer.step()`, after the step was taken during backward: the write landed on the stepped"
        " weights, and no rollback can tell what it would have done to the weights before the step."
        " HINT: write weights before the backward or after `optimizer.step()`, or pass"
        " `overlap_host_step=False` to take the step after backward."
    )


def weight_versions(host: HostChunks, shards: Sequence[Tensor]) -> list[int]:
    """The version counters of ``host``'s master row and of ``shards`` (its optimizer's views of it)."""
    return [host.master._version, *map(VERSION, shards)]


def hyperparameters_of(group: dict[str, Any], copy: bool = False) -> dict[str, Any]:
    """A param group's entries but its parameters (``copy``: a snapshot, tensors cloned and
    containers copied, since a scheduler or a hook may change them in place)."""
    return {key: _snapshot(value) if copy else value for key, value in group.items() if key != "params"}


def same_hyperparameters(group: dict[str, Any], taken: dict[str, Any]) -> bool:
    """Whether ``group`` (a live param group) holds the hyperparameters ``taken`` (a snapshot). Where
    both hold plain values only (numbers, strings, None, tuples of them: no tensor, whose ``==`` is
    elementwise, no container edited in place), one dict comparison in C says so; anything else goes
    value by value (``_same``), as does a difference (a NaN equals itself there)."""
    live = dict(group)
    live.pop("params", None)
    if _plain(taken) and _plain(live) and live == taken:
        return True
    return _same(live, taken)


_PLAIN = frozenset({float, int, bool, str, type(None)})


def _plain(entries: dict[str, Any]) -> bool:
    types = set(map(type, entries.values()))
    if tuple in types:
        types.discard(tuple)
        types.update({type(x) for t in entries.values() if type(t) is tuple for x in t})
    return types <= _PLAIN


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

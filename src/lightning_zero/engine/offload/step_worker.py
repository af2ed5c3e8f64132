"""The worker thread's side of the host step during backward: it takes every bucket that has landed
since it last woke and steps them together (see [Note: the host step during backward] in
``step_ahead.py``, and [Note: handoffs] in ``handoffs.py`` for where it meets the training thread).

One wake, one step: a bucket whose row lands while the worker is busy joins the batch queued for
its next wake instead of a job of its own, so a backward that lands buckets faster than the worker
steps them pays one handoff (a future, an event, a queue entry) and one call of the optimizer's
update per wake, not per bucket. Each bucket keeps its own record (``BucketStep``: what it read, its
rollback copy), so that a verdict or a read of one bucket's chunks undoes that bucket alone.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.comm.copy_stream import Event
from lightning_zero.engine.offload import handoffs
from lightning_zero.engine.offload.bucket_step import GRAD, BucketStep, StepBatch, hyperparameters_of, weight_versions
from lightning_zero.engine.offload.grad_digest import GradContents
from lightning_zero.engine.offload.handoffs import WorkerThread
from lightning_zero.engine.offload.host_chunks import HostChunks
from lightning_zero.engine.offload.rollback import RollbackCopy
from lightning_zero.engine.shards.precomputed_norms import remember_grad_norms

class WorkerOwner(Protocol):
    """What the worker reads of the host step that owns it (``step_ahead.StepAhead``), as each
    batch runs."""

    optimizer: Optimizer
    keep_rollback: bool
    check_contents: bool
    inv_scale: Optional[Tensor]

    unhooked: Callable[..., Any]
    """The optimizer class's own ``step``, without the hooks on it (``instance_step.unhooked_step``)."""

    copies_back: Optional["CopiesBackHook"]
    """Stages 1-2: told of each bucket the worker took, to send its weights back at once."""

    def positions_of(self, host: HostChunks) -> list[int]: ...

    def new_rollback(self, host: HostChunks, shards: Sequence[Tensor]) -> RollbackCopy: ...


class CopiesBackHook(Protocol):
    """``buckets.copies_back.CopiesBack`` as the worker sees it (see [Note: copies back per bucket])."""

    def ran(self, steps: Sequence[tuple[HostChunks, BucketStep, Optional[Event]]]) -> None: ...

    def quiesce(self) -> None: ...

    def rolled_back(self, host: HostChunks) -> None: ...


class StepWorker:
    """The worker thread of ``ahead`` (its settings read as each batch runs: ``keep_rollback``,
    ``check_contents``, ``inv_scale``), the batch queued for its next wake, and the rollback copies."""

    def __init__(self, ahead: WorkerOwner) -> None:
        self._ahead = ahead
        self.rollbacks: dict[int, RollbackCopy] = {}
        """Per bucket (``id`` of its ``HostChunks``): its master row and state before its last step."""
        self._executor: Optional[WorkerThread] = None
        self._lock = threading.Lock()
        self._queued: Optional[StepBatch] = None
        """The batch whose job is queued and has not started: a bucket that lands joins it."""
        self._landed: dict[int, list[tuple[BucketStep, Tensor, Optional[Event]]]] = {}
        """Per queued batch (``id``): its buckets' rows and copies, taken by the worker as it starts."""

    def land(self, job: BucketStep, row: Tensor, copy: Optional[Event]) -> threading.Event:
        """``job``'s row is being copied to the host (``copy``): step it at the worker's next wake
        (with every other bucket landed by then); the event is set once its gradients were handed out."""
        with self._lock:
            batch = self._queued
            first = batch is None
            if batch is None:
                batch = self._queued = StepBatch(future=Future())
                self._landed[id(batch)] = []
            batch.jobs.append(job)
            self._landed[id(batch)].append((job, row, copy))
            job.batch = batch
        if first:  # handoff: a job queued for the worker (the thread that runs backward goes on)
            assert batch.future is not None
            self._worker().submit_as(batch.future, self._run, batch)
        else:
            handoffs.hand_over(job, "a bucket joins the step queued")
        return batch.accepted

    def _worker(self) -> WorkerThread:
        if self._executor is None:
            self._executor = WorkerThread("lightning-zero-host-step")
        return self._executor

    # ---- on the worker ------------------------------------------------------------------------
    def _run(self, batch: StepBatch) -> None:
        """On the worker thread: take ``batch``'s buckets (no more join it from now on), wait for
        their rows, hand their gradients out, and step every bucket some rank gave a gradient."""
        with self._lock:
            if self._queued is batch:
                self._queued = None
            landed = self._landed.pop(id(batch))
        try:
            for job, row, copy in landed:
                if job is not batch.jobs[0]:
                    handoffs.take_over(job, "the worker takes a bucket that joined its step")
                job.host.copies.wait_on_host(copy)  # handoff (worker): backward goes on meanwhile
                host = job.host
                k = len(host.params)
                host.accept_now(row, row[host.shard_numel : host.shard_numel + k].tolist())
        finally:
            handoffs.signal(batch.accepted, "gradients handed out")
        with self._lock:  # from here on a read of a taken bucket's chunks waits for its step
            taken = [job for job in batch.jobs if not job.called_off]
            for job in taken:
                job.taken = True
        batch.start = time.perf_counter()
        stepping = [job for job in taken if self._read(job)]
        if stepping:
            batch.hyperparameters = self.step_shards([shard for job in stepping for shard in job.shards])
            for job in stepping:
                job.weights_after = weight_versions(job.host, job.shards)
                job.stepped = True
        batch.end = time.perf_counter()
        _apportion(stepping, batch.start, batch.end)
        copies_back = self._ahead.copies_back
        if copies_back is not None:  # each bucket's weights go back to the device now
            copies_back.ran([(job.host, job, copy) for job, _, copy in landed if job.taken])

    def call_off(self, job: BucketStep) -> bool:
        """Leave ``job`` to the verdict if the worker has not taken it yet (True); False: it has, and a
        read of its chunks waits for its step."""
        with self._lock:
            if not job.taken:
                job.called_off = True
            return job.called_off

    def _read(self, job: BucketStep) -> bool:
        """Record what ``job``'s step reads, before it is read: the gradients' versions, then their
        digest, then their norms (an edit racing the worker then shows in one of them at the verdict);
        save its rollback copy. False where it steps nothing: no rank used the bucket, or unscaling
        found an inf (the scaler skips this step on every rank)."""
        ahead, shards = self._ahead, job.shards
        grads = list(map(GRAD, shards))
        if grads.count(None) == len(grads):
            return False
        if ahead.inv_scale is not None:
            job.found_inf = _unscale([g for g in grads if g is not None], ahead.inv_scale)
            if job.found_inf:
                return False
        job.read(grads)
        still_valid = None
        if ahead.check_contents:
            host = job.host
            in_row = [host.holds_gradient(i, g) for i, g in zip(ahead.positions_of(host), grads)]
            job.contents = GradContents.take(host.gradient_row, grads, in_row)
            still_valid = functools.partial(_contents_unchanged, job.contents, shards)
        if ahead.keep_rollback:  # something may clip by norm: its norms are taken here, off the critical path
            remember_grad_norms(shards, still_valid=still_valid)
            rollback = self.rollbacks.get(id(job.host))
            if rollback is None:
                rollback = self.rollbacks[id(job.host)] = ahead.new_rollback(job.host, shards)
            rollback.save(ahead.optimizer.state)
            job.saved = True
        return True

    def step_shards(self, shards: Sequence[Tensor]) -> list[tuple[int, dict[str, Any]]]:
        """The optimizer's own update of ``shards``, on a view of the optimizer whose param groups hold
        only them (the user's optimizer is never narrowed: the main thread may read it meanwhile);
        returns each group's hyperparameters as stepped, by group index (a snapshot taken before the
        view reads them: a change racing the step shows at the verdict)."""
        optimizer = self._ahead.optimizer
        members = {id(s) for s in shards}
        narrowed, read = [], []
        for i, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if id(p) in members]
            if params:
                read.append((i, hyperparameters_of(group, copy=True)))
                narrowed.append({**group, "params": params})
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)
        view.param_groups = narrowed
        self._ahead.unhooked(view)
        return read

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    @property
    def rollback_bytes(self) -> int:
        return sum(copy.nbytes for copy in self.rollbacks.values())


def _apportion(jobs: Sequence[BucketStep], start: float, end: float) -> None:
    """Each job's share of one step over all of them, by elements, in order (the report's per-bucket
    timing; the optimizer's update of several buckets is one call, not timed bucket by bucket)."""
    total = sum(job.host.shard_numel for job in jobs) or 1
    at = start
    for job in jobs:
        job.start = at
        at = job.end = at + (end - start) * job.host.shard_numel / total
    if jobs:
        jobs[-1].end = end


def _contents_unchanged(contents: GradContents, shards: Sequence[Tensor]) -> bool:
    """Whether ``shards``' gradients hold what ``contents`` recorded (for a remembered norm)."""
    return contents.unchanged(list(map(GRAD, shards)))


def _unscale(grads: Sequence[Tensor], inv_scale: Tensor) -> float:
    """Unscale ``grads`` (host tensors) in place by ``inv_scale`` as ``GradScaler`` does; the inf/NaN found."""
    found = torch.zeros((), dtype=torch.float32)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale)
    return found.item()

"""The host step during backward: each offloaded bucket steps on a host thread as soon as its reduced
gradients are in host memory, and the result is bitwise the one stepping after backward gives.

[Note: the host step during backward]
With CPU offload the optimizer steps host chunks. Stepping all of them after backward puts the whole
host step on the critical path: backward, then the host step, then the copies back. But a bucket's
update reads only that bucket's chunks, gradients and state (the optimizer is element-wise, see
[Note: step granularity] in ``optimizer_kinds.py``), so it can run as soon as the bucket's reduced
row has landed, while the device computes the earlier layers' gradients:

- **when**: ``HostChunks.receive`` starts a row's copy to the host as the bucket's reduce-scatter
  finishes, during backward, and hands it to the ``StepAhead``, which queues the bucket for one
  worker thread (``step_worker.py``). The worker, when it wakes, takes every bucket landed by then,
  waits for their copies (their events, in its own thread: the host thread that runs backward never
  waits), hands the gradients out (``HostChunks.accept``, with the used flags read from the landed
  rows) and steps those buckets in one call of the optimizer's own update, on a view of the
  optimizer whose param groups are narrowed to their shards. The user's optimizer object is never
  narrowed: the main thread may read it meanwhile.
- **the verdict**: whether that is the step stepping after backward would take is known only at
  ``optimizer.step()``. Clipping by norm needs every bucket's gradients, and user code between
  backward and the step (``on_before_optimizer_step``) may edit gradients or the learning rate.
  (Where something may clip, the worker also computes each gradient's norm, which clipping then
  takes instead of reading every host gradient again after backward: ``shards/precomputed_norms.py``.) So
  each bucket records what its step read: each gradient tensor with its version counter (every
  in-place edit through autograd's view of it bumps it, every edit through ``param.grad`` too, see
  ``sharded_grad.py``; our clipping skips multiplying by exactly 1.0, which changes no bit), the
  hyperparameters of its param groups (a snapshot: tensors cloned, containers copied), and the
  version counters of its master row and shards after the step (weights written since raise: the
  write landed on the stepped weights, which no rollback can undo). Where user code may have run between backward and the
  step (the adapter says: the Trainer knows its hooks; Fabric and the engine's own API always), it
  also records a digest of the gradients' contents, taken before the step reads them, and the
  verdict takes it again: that sees what no version counter does, edits through ``.data``,
  ``.detach()`` or a NumPy view (see [Note: gradient digests] in ``grad_digest.py``).
  ``optimizer.step()`` waits for the worker and compares. All the same: the step is taken already
  (**commit**). Anything different: every bucket stepped ahead is restored from its rollback copy
  and the optimizer steps as it always did (**redo**). Bitwise the same result either way: a clip
  coefficient that is not 1 edits the gradients, so its step is redone with them.
- **reads before the verdict**: a read of a bucket's master chunks before the verdict (a gather
  during backward, of a unit backward never reached) undoes that bucket's step alone, and only if
  it moved the chunks; a bucket no rank gave a gradient steps nothing. The verdict then steps the
  buckets undone after backward and keeps the others (**redone**, ``CHUNKS_READ``).
- **rollback copies** (``rollback.py``): before a bucket steps, its master row and state are copied
  into host buffers allocated once (``memory_report().host_step_rollback``). Where the adapter knows
  nothing can change the verdict (the Trainer with no clipping, no loss scaling and no hook between
  backward and the step), none is kept, and a verdict that fails anyway raises rather than train a
  different model.
- **backing off**: a redone step costs its host step twice, plus the copies. Where clipping applies
  step after step (early in training), stepping ahead would only slow every step, so after a redone
  step the next steps are taken after backward: 1 after the first redo, then 2, 4, ... up to
  ``MAX_BACKOFF`` while redos follow one another, and stepping ahead resumes fully once a step taken
  ahead is kept (``backoff.py``). The same where a kept step did not pay: its verdict's content check (a pass over
  every gradient, after backward) and the worker's part after backward exposed more than the whole
  step after backward would have (on a machine whose host step is fast next to that pass);
  ``report()`` counts such steps with their reason (``COSTLY_REASON``).
- **switching off**: where the host step is too short to hide anything (a few milliseconds: what
  stepping ahead costs beside backward is more), the run's first steps, timed after backward, show
  it, the ranks agree, and the rest of the run steps after backward (``switch_off.py``; ``report()``
  says why, and rank zero warns).
- **never committed**: a step ahead that no ``optimizer.step()`` follows (a loop that skips the step)
  is rolled back before anything reads the chunks again: the next step, ``zero_grad``, a gather of
  the chunks, a checkpoint.
- **NVMe offload** (``offload_optimizer="nvme"``): the same, with each bucket's state read from its
  file as its gradients land and written behind to the other slot of the file; undoing a step is
  forgetting that slot, and ``optimizer.step()`` commits the slots kept (``disk_step_ahead.py``).
- **when not**: the host step waits for backward, as before, with more than one optimizer, a
  whole-tensor optimizer, the parameter chunks on NVMe (``offload_params="nvme"``), and where the adapter says a step cannot be taken ahead
  (the Trainer's manual optimization, loss scaling, clipping by value). ``report()`` counts each
  step's mode and why.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.comm.copy_stream import Event
from lightning_zero.engine.offload import handoffs
from lightning_zero.engine.offload.backoff import BACKOFF_REASON, COSTLY_REASON, BackOff, paid_off
from lightning_zero.engine.offload.bucket_step import (
    CHUNKS_READ, GRAD, GRADIENTS_CHANGED, HYPERPARAMETERS_CHANGED, WEIGHTS_WRITTEN, BucketStep, BucketStepping, StepBatch, no_rollback_error,
    weights_written_error,
)  # fmt: skip
from lightning_zero.engine.offload.host_chunks import HostChunks
from lightning_zero.engine.offload.host_step_report import HostStepReport, HostStepTiming
from lightning_zero.engine.offload.rollback import RollbackCopy
from lightning_zero.engine.offload.step_worker import CopiesBackHook, StepWorker
from lightning_zero.engine.offload.switch_off import Agree, SwitchOff
from lightning_zero.engine.optimizer.instance_step import instance_step, unhooked_step
from lightning_zero.engine.shards.sharded_param import ShardedParam

OUTSIDE_THE_BUCKETS = "gradients outside the buckets stepped ahead"


class StepAhead:
    """Steps ``optimizer``'s offloaded ``buckets`` during backward (see [Note: the host step during
    backward]). ``params``: the optimizer's sharded parameters; ``before_step()`` takes what was
    assigned to ``param.grad`` (the engine's, run before every step); ``keep_rollback``: keep copies
    to undo a step whose verdict fails; ``check_contents``: compare the gradients' contents at the
    verdict (user code may run between backward and the step); ``agree``: the largest of the ranks'
    values (for switching off, ``switch_off.py``; None: never switched off); ``rank_zero``: this
    rank warns; ``stepping``: how buckets step where not as the CPU tier's (the NVMe tier's,
    ``disk_step_ahead.py``).

    The handoffs with the worker (``step_worker.py``): ``arrived`` (a bucket queued), ``_drain`` (the
    main thread waits for the worker: the verdict, a settle) and ``_roll_back`` (a bucket's step undone)."""

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[ShardedParam],
        buckets: Sequence[tuple[int, HostChunks]],
        before_step: Callable[[], None],
        keep_rollback: bool = True,
        check_contents: bool = True,
        agree: Optional[Agree] = None,
        rank_zero: bool = True,
        stepping: Optional[BucketStepping] = None,
    ) -> None:
        self.optimizer = optimizer
        self.keep_rollback = keep_rollback
        self.check_contents = check_contents
        self._before_step = before_step
        self._stepping = stepping
        self.unhooked = stepping.step if stepping is not None else unhooked_step(optimizer)
        shards = {id(p.shard) for p in params}
        self._buckets = [(index, host) for index, host in buckets if any(id(p.shard) in shards for p in host.params)]
        self._index_of = {id(host): index for index, host in self._buckets}
        self._shards_of = {id(host): [p.shard for p in host.params if id(p.shard) in shards] for _, host in self._buckets}
        self._positions_of = {id(host): [i for i, p in enumerate(host.params) if id(p.shard) in shards] for _, host in self._buckets}
        """Per bucket: where each of its shards (``_shards_of``) sits among the bucket's parameters."""
        in_buckets = {id(s) for bucket in self._shards_of.values() for s in bucket}
        self._outside = [p.shard for p in params if id(p.shard) not in in_buckets]
        """The optimizer's shards in no bucket stepped ahead: a gradient there makes the step whole."""
        self._steps = StepWorker(self)
        self._queued: list[BucketStep] = []
        self._armed = False
        self._why_not = ""  # why the last backward was not armed
        self._backoff = BackOff()
        self._switch_off = SwitchOff(agree)
        self._rank_zero = rank_zero
        self._backward_end: Optional[float] = None
        self._counts: Counter = Counter()
        self._reasons: Counter = Counter()
        self._last: Optional[HostStepTiming] = None
        self.loss_scale: Optional[Callable[[], Optional[Tensor]]] = None
        """With loss scaling (``16-mixed``): the scaler's scale now (None before its first use). Each
        bucket's gradients are then unscaled on the worker before its step, and the scaler takes
        their verdict instead of unscaling again (``unscaled_ahead``)."""
        self.copies_back: Optional[CopiesBackHook] = None
        """Stages 1-2: sends each bucket's weights back as soon as it stepped (``buckets/copies_back.py``)."""
        self.inv_scale: Optional[Tensor] = None
        """This backward's reciprocal of the loss scale, on the host (the worker unscales by it)."""
        self._had_step = "step" in optimizer.__dict__
        self._previous_step = optimizer.__dict__.get("step")
        optimizer.step = instance_step(optimizer, self._step_or_commit)  # type: ignore[method-assign]
        _STEPS_AHEAD[optimizer] = self

    def positions_of(self, host: HostChunks) -> list[int]:
        return self._positions_of[id(host)]

    def new_rollback(self, host: HostChunks, shards: Sequence[Tensor]) -> RollbackCopy:
        """Where ``host``'s bucket keeps what its step ahead may have to undo."""
        return self._stepping.rollback(host, shards) if self._stepping is not None else RollbackCopy(host.master, shards)

    # ---- during backward -------------------------------------------------------------------
    def arm(self, armed: bool, why_not: str = "") -> None:
        """Whether the next backward's buckets step as they arrive (its micro-batch steps); if not,
        ``why_not`` (counted if the step comes after it)."""
        off = self._switch_off.why_not() or self._backoff.why_not()
        if armed and off:
            armed, why_not = False, off
        if armed and self.loss_scale is not None and self.inv_scale is None:
            scale = self.loss_scale()
            if scale is None:  # the scaler has not scaled a loss yet: nothing to unscale by
                armed, why_not = False, "loss scale not known before the backward"
            else:  # a host sync before forward, once per step: the worker unscales on the host
                self.inv_scale = scale.double().reciprocal().float().to("cpu")  # as GradScaler computes it
        self._armed = armed
        self._why_not = "" if armed else why_not
        for _, host in self._buckets:
            host.arrivals = self if armed else None

    @property
    def armed(self) -> bool:
        return self._armed

    def arrived(self, host: HostChunks, row: Tensor, copy: Event) -> threading.Event:
        """``host``'s reduced ``row`` is being copied to the host (``copy``): queue its step; the
        returned event is set once its gradients were handed out (``HostChunks.accept``). From now
        until the verdict, a read of the bucket's chunks undoes its step first (``_settle_bucket``)."""
        job = BucketStep(host, self._index_of[id(host)], self._shards_of[id(host)])
        if self._stepping is not None:
            self._stepping.arrived(host, job.shards)
        self._queued.append(job)
        host.unsettled = functools.partial(self._settle_bucket, job)
        return self._steps.land(job, row, copy)

    def backward_ended(self) -> None:
        """Backward's gradients are all computed (``finish_backward`` begins): no more arrive ahead."""
        self._backward_end = time.perf_counter()

    def disarm(self) -> None:
        """No more arrivals step (backward ended); keeps why the backward was not armed."""
        self._armed = False
        for _, host in self._buckets:
            host.arrivals = None

    def unscaled_ahead(self, inv_scale: Tensor) -> Optional[float]:
        """For the scaler's ``unscale_``: where this backward's gradients were unscaled on the worker
        (by ``inv_scale``), the inf/NaN they held (summed over the buckets); None where they were not."""
        if self.inv_scale is None or not self._queued:
            return None
        self._drain()
        if not torch.equal(inv_scale.to("cpu"), self.inv_scale):
            raise RuntimeError(
                "The loss scale changed between backward and unscaling (`GradScaler.update()` ran in"
                " between); the gradients were unscaled during backward by the scale before."
            )
        return sum(job.found_inf for job in self._queued)

    # ---- the verdict ------------------------------------------------------------------------
    def _step_or_commit(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> None:
        """``optimizer.step``'s update (after the closure, inside torch's hooks): the verdict, and the
        optimizer's own update where nothing was stepped ahead or the steps ahead were undone."""
        mode, verdict_s = self._verdict(whole=bool(kwargs))
        after_s = 0.0
        if mode != "ahead":
            start = time.perf_counter()
            settled = [job for job in self._queued if job.settled]
            if settled:  # the buckets read before the verdict step now; the others are kept
                self._steps.step_shards([shard for job in settled for shard in job.shards])
            else:
                self._switch_off.host_step_starts()
                self.unhooked(optimizer, **kwargs)
                self._switch_off.host_step_ended()
            after_s = time.perf_counter() - start
        self._counts[mode] += 1
        self._last = self._timing(mode, after_s, verdict_s)
        paid = mode != "ahead" or paid_off(self._last)
        self._backoff.after_step(mode, paid, was_backing_off=self._why_not in (BACKOFF_REASON, COSTLY_REASON))
        self._clear()
        if self._switch_off.after_step() and self._rank_zero:
            self._switch_off.warn()

    def stop_backing_off(self) -> None:
        """Step ahead from the next step on, whatever was redone lately (not where switched off)."""
        self._backoff.stop()

    def _verdict(self, whole: bool = False) -> tuple[str, float]:
        """"ahead" when every bucket stepped ahead read what stepping now would read (the step is
        taken); "redone" when one did not (they are rolled back, the optimizer steps again), or one
        was undone because its chunks were read (it steps now, the others are kept, unless ``whole``:
        the step takes arguments, so it is taken whole); "after_backward" when nothing was stepped
        ahead. And the seconds the comparisons took."""
        self._drain()
        for job in self._queued:  # a step called off before the worker took it, of a bucket no rank used
            if job.called_off and list(map(GRAD, job.shards)).count(None) == len(job.shards):
                job.settled = False
        if not any([job.stepped for job in self._queued]):
            for job in self._queued:
                job.settled = False  # the whole step is taken after backward
            if not self._queued:
                self._reasons[self._why_not or "no backward armed before the step"] += 1
            return "after_backward", 0.0
        start = time.perf_counter()
        self._before_step()
        handoffs.point("verdict")
        if self.check_contents and any([job.contents is not None for job in self._queued]):
            self._counts["content_checks"] += 1
        settled = any([job.settled for job in self._queued])
        changed = self._what_changed() or (CHUNKS_READ if settled and whole else "")
        if changed == WEIGHTS_WRITTEN:
            self._clear()
            raise weights_written_error()
        if not changed and settled:
            self._reasons[CHUNKS_READ] += 1
            return "redone", time.perf_counter() - start
        if not changed:
            return "ahead", time.perf_counter() - start
        self._undo(changed)
        for job in self._queued:
            job.settled = False  # the whole step is taken again
        self._reasons[changed] += 1
        return "redone", time.perf_counter() - start

    def _timing(self, mode: str, after_s: float, verdict_s: float) -> HostStepTiming:
        stepped = [job for job in self._queued if job.stepped] if mode != "after_backward" else []
        buckets = tuple([(job.index, job.start, job.end) for job in stepped])
        host_step_s = sum([job.end - job.start for job in stepped]) + after_s
        return HostStepTiming(mode, buckets, self._backward_end, host_step_s, verdict_s)

    def _what_changed(self) -> str:
        """Why the steps taken ahead are not the ones to take now ("" if they are): weights written
        since (first: no rollback may then hide the write), then what metadata tells of every bucket
        (a constant number of C-level comparisons each, see ``bucket_step.py``), then, where asked,
        the gradients' contents (the one check that reads them)."""
        held = [job for job in self._queued if job.holds_step]
        if any([job.weights_written() for job in held]):
            return WEIGHTS_WRITTEN
        if any([job.gradients_changed() for job in held]):
            return GRADIENTS_CHANGED
        groups = self.optimizer.param_groups
        if any([batch.hyperparameters_changed(groups) for batch in _batches(held)]):
            return HYPERPARAMETERS_CHANGED
        if self._gradients_outside(held):
            return OUTSIDE_THE_BUCKETS
        if self.check_contents:
            return next((why for why in [job.contents_changed() for job in held] if why), "")
        return ""

    def _gradients_outside(self, held: Sequence[BucketStep]) -> bool:
        """Whether a shard of the optimizer holds a gradient that no step taken ahead read (its bucket
        not stepped, or in no bucket), where the bucket's chunks were not undone to step now."""
        covered = {id(job.host) for job in self._queued if job.settled}
        covered.update([id(job.host) for job in held])
        shards = [self._shards_of[id(host)] for _, host in self._buckets if id(host) not in covered]
        shards.append(self._outside)
        return any([list(map(GRAD, bucket)).count(None) != len(bucket) for bucket in shards])

    def _undo(self, why: str) -> None:
        """Restore every bucket stepped ahead (the worker is idle)."""
        if not self.keep_rollback:
            self._clear()
            raise no_rollback_error(why)
        handoffs.point("rollback")
        for job in reversed(self._queued):
            self._roll_back(job)
            job.host.unsettled = None

    def _roll_back(self, job: BucketStep) -> None:
        """Handoff: ``job``'s bucket back as before its step (the worker is done with it)."""
        if job.saved and job.holds_step:
            if self.copies_back is not None:  # its weights may still be on their way to the device
                self.copies_back.quiesce()
            self._steps.rollbacks[id(job.host)].restore(self.optimizer.state)
            if self.copies_back is not None:
                self.copies_back.rolled_back(job.host)
        job.undone = True

    def _settle_bucket(self, job: BucketStep) -> None:
        """Before a read of ``job``'s chunks ahead of the verdict (``HostChunks.unsettled``): where the
        worker has not taken it, call its step off; else wait for its step and undo it if it stepped
        (torch's fused CPU kernels, which the host step uses, move no version counter, so whether
        the chunks moved is known from the job, not the tensors). The verdict steps it then (see
        "reads before the verdict"). Never waiting for a step not taken is what keeps this wait off
        the peers: a bucket's step waits for its row's copy, which on a GPU waits for its
        reduce-scatter, which a peer may reach only after this rank's read (a gather of a unit its
        backward never reached: the schedule explorer's ``stage3_params_offloaded_late_rank``)."""
        job.host.unsettled = None
        if self._steps.call_off(job):
            job.settled = True
            return
        if job.future is not None and handoffs.join(job.future, "a read of the chunks waits for their step") is not None:
            self._drain()  # raises, after undoing what was stepped
        if not job.holds_step:  # not stepped (no rank gave the bucket a gradient) or already undone
            return
        if not self.keep_rollback:
            self._drain()
            self._clear()
            raise no_rollback_error(CHUNKS_READ)
        self._roll_back(job)
        job.settled = True

    def settle(self, why: str = CHUNKS_READ) -> None:
        """Undo every step taken ahead that is not committed yet (anything about to read all chunks or
        the state, or a next step that comes without ``optimizer.step()``); a no-op when there is none."""
        if not self._queued:
            return
        self._drain()
        if any([job.holds_step for job in self._queued]):
            self._undo(why)
        self._reasons[why] += 1
        self._clear()

    def wait(self) -> None:
        """Wait for the worker's steps queued so far (their errors raised here)."""
        self._drain()

    def _drain(self) -> None:
        """Handoff: the main thread waits for the worker's jobs (one per batch of buckets); where one
        failed, undo what was stepped ahead and re-raise."""
        errors = [handoffs.join(b.future, "the verdict waits for the host step") for b in _batches(self._queued) if b.future is not None]
        error = next((e for e in errors if e is not None), None)
        if error is None:
            return
        for job in reversed(self._queued):
            self._roll_back(job)
        self._clear()
        raise RuntimeError("The optimizer step taken on a host thread during backward failed (the error above).") from error

    def _clear(self) -> None:
        for job in self._queued:
            job.host.unsettled = None
        self._queued = []
        self.inv_scale = None

    # ---- what the user sees ---------------------------------------------------------------------
    def report(self) -> HostStepReport:
        return HostStepReport(
            ahead=self._counts["ahead"],
            redone=self._counts["redone"],
            after_backward=self._counts["after_backward"],
            reasons=dict(self._reasons),
            rollback_bytes=self.rollback_bytes,
            last=self._last,
            content_checks=self._counts["content_checks"],
            switched_off=self._switch_off.reason,
        )

    @property
    def rollback_bytes(self) -> int:
        return self._steps.rollback_bytes

    def close(self) -> None:
        """Undo anything uncommitted, stop the worker, give the optimizer its own ``step`` back."""
        _STEPS_AHEAD.pop(self.optimizer, None)
        try:
            if self.keep_rollback or not any([job.holds_step for job in self._queued]):
                self.settle("the engine closed before `optimizer.step()`")
            else:  # nothing to undo with (a run that failed mid-step): the chunks keep the step
                self._drain()
                self._clear()
        finally:
            self.disarm()
            self._steps.shutdown()
            if self._had_step:
                self.optimizer.step = self._previous_step  # type: ignore[method-assign]
            else:
                self.optimizer.__dict__.pop("step", None)


_STEPS_AHEAD: "weakref.WeakKeyDictionary[Optimizer, StepAhead]" = weakref.WeakKeyDictionary()


def step_ahead_of(optimizer: Optimizer) -> Optional[StepAhead]:
    """The ``StepAhead`` stepping ``optimizer`` during backward, if any (the loss scaler asks)."""
    return _STEPS_AHEAD.get(optimizer)


def _batches(jobs: Sequence[BucketStep]) -> list[StepBatch]:
    """The worker's batches that took ``jobs``, each once, in order."""
    return [batch for batch in dict.fromkeys([job.batch for job in jobs]) if batch is not None]

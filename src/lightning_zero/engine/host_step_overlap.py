"""The engine's side of the host step during backward (CPU and NVMe offload): whether it applies to the bound
optimizers, the adapter's plan, and where the engine's step arms, settles and ends it. The mechanism is
``offload/step_ahead.py`` ([Note: the host step during backward]); the adapters' plans are
``lightning/host_step_plan.py`` and the Fabric strategy's ``backward``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.optim import Optimizer

from lightning_zero.engine.buckets.bucket import Bucket
from lightning_zero.engine.buckets.copies_back import ChunksBack, CopiesBack, largest_over_ranks
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.gradients.grad_sync import GradientSync
from lightning_zero.engine.offload.disk_step_ahead import DiskStepping
from lightning_zero.engine.offload.disk_tier import DiskTier
from lightning_zero.engine.offload.host_step_report import HostStepReport
from lightning_zero.engine.offload.step_ahead import StepAhead
from lightning_zero.engine.optimizer.optimizer_kinds import steps_bucket_by_bucket
from lightning_zero.engine.shards.sharded_param import ShardedParam

LossScale = Callable[[], Optional[torch.Tensor]]


@dataclass(frozen=True)
class HostStepPlan:
    """What the adapter said of taking offloaded steps during backward (``ZeroEngine.plan_host_step``)."""

    ahead: bool = True
    keep_rollback: bool = True
    reason: str = ""
    """Why not ``ahead`` (counted)."""
    loss_scale: Optional[LossScale] = None
    check_contents: bool = True
    """Compare the gradients' contents at the verdict: user code may run between backward and the
    step, and edit them where no version counter sees it (see [Note: gradient digests] in
    ``offload/grad_digest.py``). False only where the adapter knows no user code runs there."""


@dataclass(frozen=True)
class ScaleOf:
    """A loss scaler's scale now, as ``HostStepPlan.loss_scale``: two of the same scaler compare equal,
    so an adapter that plans again every backward (Fabric) leaves the plan, and its backing off, as
    they are."""

    scaler: Any
    """A ``torch.amp.GradScaler`` (its ``_scale``: None before its first use)."""

    def __call__(self) -> Optional[torch.Tensor]:
        return self.scaler._scale


class HostStepOverlap:
    """The ``StepAhead`` of an engine's one offloaded optimizer, where it has one.

    ``optimizers()`` and ``params_of``: the engine's bound optimizers and their sharded parameters;
    ``steps_whole_tensors``: whether one steps on owner ranks; ``buckets``: the engine's offloaded
    buckets; ``take_assignments``: what runs before every step (``param.grad`` assignments);
    ``grad_sync``: finishes reductions early while a backward is armed."""

    def __init__(
        self,
        config: ZeroConfig,
        optimizers: Callable[[], Sequence[Optimizer]],
        params_of: Callable[[Optimizer], Sequence[ShardedParam]],
        steps_whole_tensors: Callable[[Optimizer], bool],
        buckets: Callable[[], Sequence[Bucket]],
        take_assignments: Callable[[], None],
        grad_sync: GradientSync,
        disk: Optional[DiskTier] = None,
        copies_back: Optional[Union[CopiesBack, ChunksBack]] = None,
    ) -> None:
        self._config = config
        self._optimizers = optimizers
        self._params_of = params_of
        self._steps_whole_tensors = steps_whole_tensors
        self._buckets = buckets
        self._take_assignments = take_assignments
        self._grad_sync = grad_sync
        self._disk = disk
        self.copies_back = copies_back
        """Each bucket's weights back to the device as soon as it stepped (see [Note: copies back per
        bucket] in ``buckets/copies_back.py``): stages 1-2 its write-back, stage 3 its device chunks."""
        self._backward_in_round = False
        self.plan = HostStepPlan()
        self.ahead: Optional[StepAhead] = None
        self._finished: Optional[HostStepReport] = None
        self.bind()

    def set_plan(self, plan: HostStepPlan) -> None:
        """Take ``plan`` from the next step on; a plan other than the one in force starts afresh
        (stepping ahead again, whatever was redone lately), the same one changes nothing."""
        changed, self.plan = plan != self.plan, plan
        if self.ahead is not None and changed:
            self.ahead.keep_rollback = plan.keep_rollback
            self.ahead.check_contents = plan.check_contents
            self.ahead.loss_scale = plan.loss_scale
            self.ahead.stop_backing_off()

    def bind(self) -> Optional[StepAhead]:
        """The ``StepAhead`` for the optimizers bound now: built before the first ``optimizer.step()``
        (which, in Lightning, runs the first backward); None where the step runs after backward:
        no offload, the parameter chunks on NVMe (``offload_params="nvme"``: their stream steps
        after backward), several optimizers (each would need its own verdict), a whole-tensor
        optimizer or one whose step may count in its param groups (``steps_bucket_by_bucket``), no
        trainable offloaded bucket. With the state on NVMe the buckets step through its stream
        (``offload/disk_step_ahead.py``)."""
        config = self._config
        if not (config.offload_optimizer and config.overlap_host_step) or config.params_on_disk:
            return None  # every step of a run without CPU or NVMe offload: no further work
        optimizers = list(self._optimizers())
        if self.ahead is not None and [self.ahead.optimizer] == optimizers:
            return self.ahead
        self.close()
        if len(optimizers) != 1:
            return None
        if self._steps_whole_tensors(optimizers[0]) or not steps_bucket_by_bucket(optimizers[0]):
            return None
        buckets = [(b.index, b.host) for b in self._buckets() if b.host is not None and b.host.grads is not None]
        if not buckets:
            return None
        plan, first = self.plan, self._buckets()[0]
        stepping = None
        if self._disk is not None:
            state = self._disk.state_of(optimizers[0])
            if state is None:
                return None
            stepping = DiskStepping(state)
        self.ahead = StepAhead(
            optimizers[0], self._params_of(optimizers[0]), buckets, self._take_assignments, plan.keep_rollback, plan.check_contents,
            agree=functools.partial(largest_over_ranks, first), rank_zero=collectives.rank() == 0, stepping=stepping,
        )  # fmt: skip
        self.ahead.loss_scale = plan.loss_scale
        self.ahead.copies_back = self.copies_back
        return self.ahead

    def arm(self, sync_gradients: bool) -> None:
        """Before a step's backward: undo a step taken ahead that no ``optimizer.step()`` followed,
        then arm the buckets to step as they arrive, if this micro-batch steps."""
        ahead = self.bind()
        if ahead is None:
            return
        ahead.settle("no `optimizer.step()` followed the backward")
        self._open_round(sync_gradients)
        ahead.arm(self.plan.ahead and sync_gradients, self.plan.reason or "the adapter takes the step after backward")
        self._grad_sync.finish_early = ahead.armed

    def _open_round(self, sync_gradients: bool) -> None:
        """Before a backward: close a write-back round whose backward no step followed, and open one
        where this backward steps and no user code may read the weights before the step. The same on
        every rank: it depends on the plan and the loop, never on this rank's stepping ahead."""
        copies = self.copies_back
        if not isinstance(copies, CopiesBack):  # stage 3's refreshes need no round
            return
        if copies.round_open and self._backward_in_round:
            copies.close()
        if sync_gradients and not self.plan.check_contents and not copies.round_open:
            copies.open_round(may_undo=self.plan.keep_rollback)
            self._backward_in_round = False

    def backward_ended(self) -> None:
        if self.ahead is not None:
            self.ahead.backward_ended()

    def reductions_finished(self) -> None:
        """Every bucket's row has gone to the host: no more arrive in this backward."""
        self._backward_in_round = True
        if self.ahead is not None:
            self.ahead.disarm()
            self._grad_sync.finish_early = False

    def settle(self, why: str) -> None:
        """Something is about to read or write the chunks: undo a step taken ahead and not committed."""
        if self.ahead is not None:
            self.ahead.settle(why)

    def wait(self) -> None:
        if self.ahead is not None:
            self.ahead.wait()

    def report(self) -> Optional[HostStepReport]:
        return self.ahead.report() if self.ahead is not None else self._finished

    @property
    def rollback_bytes(self) -> int:
        return self.ahead.rollback_bytes if self.ahead is not None else 0

    def close(self) -> None:
        if self.ahead is not None:
            self._finished = self.ahead.report()  # still reported after `fit`
            self._grad_sync.finish_early = False
            self.ahead.close()
            self.ahead = None



"""The host step during backward with the optimizer state on NVMe: how the worker of
``step_ahead.py`` steps a bucket whose state lives in a scratch file, and how such a step is undone
(see [Note: the host step during backward] in ``step_ahead.py`` and [Note: optimizer state on disk]
in ``state_on_disk.py``).

- **stepping**: the worker's update of a batch of buckets is the NVMe stream of those buckets
  (``OptimizerStateOnDisk.step_body`` on the view narrowed to their shards): each bucket's state was
  wanted as its gradients landed (its read issued then, if a staging buffer was free), is stepped
  once read, and written behind to the *other* slot of its file. The stream after backward (a redo,
  the buckets read before the verdict, a step not taken ahead) is the same stream on the whole
  optimizer.
- **rollback**: the master chunks (in host memory with ``offload_params`` True or False) and the
  state the optimizer keeps in memory (Adam's ``step`` counts) are copied before the step, as the
  CPU tier's ``RollbackCopy`` does; the per-element state needs no copy: its step went to the other
  slot, so undoing it is forgetting that slot (``BucketState.discard``). The end of
  ``optimizer.step()`` commits every slot written and not undone (``OptimizerStateOnDisk.commit``),
  after waiting for the writes, so a failed write fails the step with every bucket's state as it was.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.offload.host_chunks import HostChunks
from lightning_zero.engine.offload.rollback import RollbackCopy
from lightning_zero.engine.offload.state_on_disk import OptimizerStateOnDisk


class DiskRollback(RollbackCopy):
    """A bucket's master row and in-memory state as ``RollbackCopy`` keeps them; restoring also
    forgets the slot its step wrote (the current slot holds the state before the step)."""

    def __init__(self, master: Tensor, shards: Sequence[Tensor], state: OptimizerStateOnDisk) -> None:
        super().__init__(master, shards)
        self._state = state

    def restore(self, state: dict[Tensor, dict[str, Any]]) -> None:
        super().restore(state)
        self._state.discard(self._shards)


class DiskStepping:
    """What ``StepAhead`` asks of the way buckets step, for an optimizer whose state is on disk (the
    CPU tier's default: the optimizer class's own update, ``RollbackCopy``, nothing at a landing)."""

    def __init__(self, state: OptimizerStateOnDisk) -> None:
        self._state = state

    def step(self, source: Optimizer, **step_kwargs: Any) -> None:
        """The update of ``source``'s parameters (the optimizer, or a view narrowed to some buckets)."""
        self._state.step_body(source, **step_kwargs)

    def rollback(self, host: HostChunks, shards: Sequence[Tensor]) -> RollbackCopy:
        return DiskRollback(host.master, shards, self._state)

    def arrived(self, host: HostChunks, shards: Sequence[Tensor]) -> None:
        """``host``'s gradients are landing (during backward): read its state ahead now."""
        if shards:
            self._state.want(shards[0])

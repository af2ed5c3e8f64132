"""When each ZeRO-3 unit is gathered and freed: the module and autograd hooks of stage 3.

Per step, for a unit U (the root unit is gathered by ``begin_step`` and freed by ``end_step``, as
its parameters may be used anywhere in the step):

- forward pre-hook: gather U (waiting for its prefetch), then prefetch the units that followed U
  in the previous forward;
- forward post-hook: free U; under autograd, hook U's outputs so that the first gradient reaching
  them gathers U again (see [Note: backward gather order]), and hook U's inputs so that once
  their gradients are computed — U's backward is over — U is freed again; a module called several
  times in one forward is freed after the backward of its last pending call only (its calls'
  hooks fire in no fixed order where one call's output is the next one's input);
- if no input of U needs a gradient, U's backward ends with the last of its trainable parameters'
  gradient accumulation, which then frees it (``grad_accumulated``, called from the one
  post-accumulate-grad hook per parameter that the gradient sync registers);
- anything still gathered when backward ends is freed there.

With ``offload_params="nvme"`` each gather's chunks are read from disk first: the unit after those
being prefetched (in forward order, and in the backward queue) is read ahead (``Unit.read_ahead``),
so that a gather finds its chunks in memory (see [Note: parameters on disk] in
``masters_on_disk.py``).

All-gathers are issued in forward order (and its reverse in backward) on a process group of their
own, so they never interleave with the reduce-scatters, whose order is fixed by the buckets.

[Note: backward gather order]
Collectives are matched by the order each rank issues them, so every rank must issue the same
backward all-gathers in the same order, even where the ranks' backwards differ: a rank whose loss
is detached from the first blocks (or that skips a unit's backward for any data-dependent reason)
never reaches those units' gradient hooks, and would leave its peers waiting in an all-gather
forever. So the backward gathers follow a queue that every rank derives from its forward, not from
its gradients: the units whose outputs needed a gradient, in reverse order of their last forward
call. A unit's first gradient issues the queue up to that unit (and ``prefetch_units`` beyond);
units that are never reached are issued by ``finish_backward_gathers`` before the gradients are
reduced, gathered and freed at once. The forwards agree across ranks (the unit tags check that),
hence so do the queues. A unit reached again after its backward freed it (a recomputing
checkpoint) is gathered on demand, as every rank does alike.

[Note: gathers under torch.compile]
The unit hooks run eagerly under ``torch.compile`` (``torch._dynamo.disable``): the graph breaks at
each unit boundary and each unit's own forward is captured whole. Traced into, the hooks' Python
state (unit states, the queue, counters keyed by buffer size) made Dynamo specialize on values
that change from unit to unit and recompile until its cache limit with inductor; the collectives
and storage resizes inside break the graph there anyway.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.parameters.unit import Unit, UnitState
from lightning_zero.engine.shards.sharded_param import ShardedParam


def _weakly(schedule: "GatherSchedule", method: Callable[["GatherSchedule", Unit], None], index: int) -> Callable[[Any], None]:
    """An autograd hook calling ``method(schedule, unit)`` that holds the schedule weakly.

    torch's ``register_multi_grad_hook(mode="all")`` keeps the hooked tensors' autograd nodes in
    the hook's closure while the nodes keep the hook: a cycle through C++ that Python's garbage
    collector cannot see, so a hook holding the schedule would keep the whole engine, the module and
    the Trainer alive for the life of the process (measured: every stage-3 run's, before this)."""
    ref = weakref.ref(schedule)

    def hook(_: Any) -> None:
        alive = ref()
        if alive is not None:
            method(alive, alive.units[index])

    return hook


def _grad_tensors(*trees: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(trees)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class GatherSchedule:
    """Registers and runs the stage-3 hooks for ``units`` (the root first)."""

    def __init__(self, units: Sequence[Unit], prefetch_units: int) -> None:
        self.units = list(units)
        self.root = self.units[0]
        self.prefetch_units = prefetch_units
        self._handles: list[RemovableHandle] = []
        self._forward_order: list[int] = []  # unit indices in the order their forward ran
        self._previous_order: list[int] = []
        # What ends each unit's backward; filled by its forward calls, cleared by each backward's end
        # (manual optimization runs several backwards per step):
        self._backward_calls_pending: dict[int, int] = {}  # calls with an input that needs a gradient
        self._grads_pending: dict[int, set[int]] = {}  # for a call without one: its trainable parameters
        # the backward gather queue (see [Note: backward gather order]):
        self._called_with_grad: list[int] = []  # units whose forward output needs a gradient, in call order
        self._backward_queue: Optional[list[Unit]] = None  # made at this backward's first gradient hook
        self._queue_position: dict[int, int] = {}
        self._issued = 0  # queue entries whose gather has been issued
        self._unit_of: dict[int, Unit] = {id(p): unit for unit in self.units[1:] for p in unit.params}
        self.open()

    def open(self) -> None:
        """Register the units' module hooks (at construction, and again when a module kept sharded
        after ``fit`` is used again; a no-op while they are registered)."""
        if self._handles:
            return
        for unit in self.units[1:]:
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(self._post_forward(unit), with_kwargs=True))

    # ---- step boundaries -----------------------------------------------------------------------
    def begin_step(self) -> None:
        if self._forward_order:
            self._previous_order = self._forward_order
        self._forward_order = []
        self._forget_backward()
        for index in self._previous_order[: 1 + self.prefetch_units]:  # their reads overlap the root's
            self.units[index].read_ahead()
        self.root.unshard()

    def end_backward(self) -> None:
        for unit in self.units[1:]:
            unit.reshard()
        self._forget_backward()

    def finish_backward_gathers(self) -> None:
        """Gather (and free) the units this rank's backward never reached, in queue order, so that
        peers whose backward does reach them are not left waiting (see [Note: backward gather
        order]). Called after backward, before its gradients are reduced."""
        queue = self._queue()
        while self._issued < len(queue):
            unit = queue[self._issued]
            self._issued += 1
            if unit.state is UnitState.SHARDED:
                unit.unshard()
                unit.reshard()

    def _forget_backward(self) -> None:
        self._backward_calls_pending.clear()
        self._grads_pending.clear()
        self._called_with_grad.clear()
        self._backward_queue, self._queue_position, self._issued = None, {}, 0

    def end_step(self) -> None:
        for unit in self.units:
            unit.reshard()

    def replay_evaluation_step(self) -> None:
        """Issue the gathers of an evaluation step without running it: those of this rank's last
        step, in its forward order (a rank out of batches shadowing its peers, see
        ``evaluation_join.py``)."""
        order = self._forward_order or self._previous_order or [unit.index for unit in self.units[1:]]
        self.root.unshard()
        for index in order:
            self.units[index].unshard()
            self.units[index].reshard()
        self.root.reshard()

    def refresh_gathered(self) -> None:
        """After an optimizer step: gathered units hold stale weights; gather them anew."""
        for unit in self.units:
            if unit.state is not UnitState.SHARDED:
                unit.reshard()
                unit.unshard()

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit):
        @torch._dynamo.disable  # see [Note: gathers under torch.compile]
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            unit.unshard()
            self._forward_order.append(unit.index)
            self._prefetch_after(unit.index, len(self._forward_order) - 1)

        return hook

    def _post_forward(self, unit: Unit):
        @torch._dynamo.disable  # see [Note: gathers under torch.compile]
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            unit.reshard()
            if not torch.is_grad_enabled():
                return output
            outputs, inputs = _grad_tensors(output), _grad_tensors(args, kwargs)
            if outputs:
                self._called_with_grad.append(unit.index)
                register_multi_grad_hook(outputs, _weakly(self, GatherSchedule._pre_backward, unit.index), mode="any")
            if outputs and not inputs:
                self._grads_pending[unit.index] = {id(p) for p in unit.params if p.param.requires_grad}
            if inputs:
                self._backward_calls_pending[unit.index] = self._backward_calls_pending.get(unit.index, 0) + 1
                register_multi_grad_hook(inputs, _weakly(self, GatherSchedule._call_backward_ended, unit.index), mode="all")
            return output

        return hook

    def _call_backward_ended(self, unit: Unit) -> None:
        remaining = self._backward_calls_pending.get(unit.index, 1) - 1
        self._backward_calls_pending[unit.index] = remaining
        if remaining <= 0 and not self._grads_pending.get(unit.index):
            unit.reshard()

    def _pre_backward(self, unit: Unit) -> None:
        position = self._position_in_queue(unit)
        freed_after_its_turn = position is not None and position < self._issued and unit.state is UnitState.SHARDED
        if position is None or freed_after_its_turn:  # not queued, or reached again: on demand
            unit.unshard()
            return
        self._issue_through(position)
        unit.unshard()
        self._issue_through(position + self.prefetch_units)
        queue = self._queue()
        if position + self.prefetch_units + 1 < len(queue):
            queue[position + self.prefetch_units + 1].read_ahead()

    def _queue(self) -> list[Unit]:
        """This backward's gather queue, made from the forward calls before it (see [Note:
        backward gather order])."""
        if self._backward_queue is None:
            order = list(dict.fromkeys(reversed(self._called_with_grad)))  # reverse order of last call
            self._backward_queue = [self.units[i] for i in order]
            self._queue_position = {index: position for position, index in enumerate(order)}
        return self._backward_queue

    def _position_in_queue(self, unit: Unit) -> Optional[int]:
        self._queue()
        return self._queue_position.get(unit.index)

    def _issue_through(self, position: int) -> None:
        queue = self._queue()
        while self._issued <= min(position, len(queue) - 1):
            queue[self._issued].start_unshard()
            self._issued += 1

    def grad_accumulated(self, param: ShardedParam) -> None:
        """``param``'s gradient for this backward is accumulated: the last one of a unit whose
        inputs need no gradient ends that unit's backward (see the module docstring)."""
        unit = self._unit_of.get(id(param))
        pending = self._grads_pending.get(unit.index) if unit is not None else None
        if pending is None:
            return
        pending.discard(id(param))
        if not pending and self._backward_calls_pending.get(unit.index, 0) <= 0:
            unit.reshard()

    def _prefetch_after(self, index: int, position: int) -> None:
        order = self._previous_order
        if self.prefetch_units <= 0 or position + 1 >= len(order) or order[position] != index:
            return  # no record yet, or this forward already left last step's path
        for later in order[position + 1 : position + 1 + self.prefetch_units]:
            self.units[later].start_unshard()
        for later in order[position + 1 + self.prefetch_units : position + 2 + self.prefetch_units]:
            self.units[later].read_ahead()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

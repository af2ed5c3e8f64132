"""When each ZeRO-3 unit is gathered and freed: the module and autograd hooks of stage 3.

Per step, for a unit U (the root unit is gathered by ``begin_step`` and freed by ``end_step``, as
its parameters may be used anywhere in the step):

- forward pre-hook: gather U (waiting for its prefetch), then prefetch the units that followed U
  in the previous forward;
- forward pre-hook, under autograd: U's inputs that need a gradient pass through
  a :class:`_UnitBoundary`, an identity whose backward runs once their gradients are computed —
  U's backward is over — and frees U again; a module called several times in one forward is freed
  after the backward of its last pending call only (its calls' ends come in no fixed order where
  one call's output is the next one's input);
- forward post-hook: free U; under autograd, U's outputs pass through
  a :class:`_UnitBoundary`, an identity whose backward runs before any of U's and gathers U
  again (see [Note: backward gather order]);
- if no input of U needs a gradient, U's backward ends with the last of its trainable parameters'
  gradient accumulation, which then frees it (``grad_accumulated``, called from the one
  post-accumulate-grad hook per parameter that the gradient sync registers while it learns; once
  it trusts the unit ends, those hooks are gone and such a unit is freed when backward ends, see
  [Note: readiness per unit] in ``gradients/unit_readiness.py``);
- the end of U's backward is also told to the gradient sync (``unit_backward_ended``): U's
  gradient buckets may be reduced from then on;
- anything still gathered when backward ends is freed there;
- hpZ: a training forward's gather keeps the unit's secondary shards, backward's gathers of it come
  from them, and every "free" above (not the forward post-hook's) frees them (see [Note: secondary
  shards] in ``secondary_shards.py``); a gather issued while a backward is running (a prefetch in
  backward's queue, a recompute's) is backward's;
- except that all-frozen units within ``keep_frozen_units_mb`` stay gathered from their first
  forward until the optimizer step (``KeptFrozenUnits``, see [Note: kept frozen units] in
  ``kept_units.py``): every "free" above skips them, and their later gathers find them gathered.

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

[Note: hooks registered once]
The module hooks are registered once (``open``); each call then costs two identity autograd
nodes (one on the inputs, one on the outputs), not two hooks registered on its tensors. The
usual arguments — a tuple of tensors, a tensor out — are handled without flattening them.

[Note: gathers under torch.compile]
The unit hooks run eagerly under ``torch.compile`` (``torch._dynamo.disable``): the graph breaks at
each unit boundary and each unit's own forward is captured whole. An eager call pays the wrapper:
4 Python calls and about 0.4 µs (measured on the CPU), 2 per unit call; a check of
``torch.compiler.is_compiling()`` in an undecorated hook costs half that but makes Dynamo trace the
hook's closure and recompile for every unit. Traced into, the hooks' Python
state (unit states, the queue, counters keyed by buffer size) made Dynamo specialize on values
that change from unit to unit and recompile until its cache limit with inductor; the collectives
and storage resizes inside break the graph there anyway.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zero.engine.shards.host_work import HOST_WORK
from lightning_zero.engine.parameters.kept_units import KeptFrozenUnits
from lightning_zero.engine.parameters.module_hooks import ModuleHooks
from lightning_zero.engine.parameters.unit import GatherKind, Unit, UnitState
from lightning_zero.engine.shards.sharded_param import ShardedParam


class _UnitBoundary(torch.autograd.Function):
    """Identity on a unit call's tensors; its backward calls ``on_backward(schedule, unit)``:
    ``GatherSchedule._pre_backward`` on the call's outputs (it runs before any of the unit's
    backward), ``GatherSchedule._call_backward_ended`` on its inputs that need a gradient (it runs
    once their gradients are computed: the call's backward is over). The schedule is held weakly."""

    @staticmethod
    def forward(ctx: Any, target: "_Target", *tensors: torch.Tensor) -> Any:
        # ``detach()``ed aliases, not views, so that code may still modify them in place (a custom
        # Function's view outputs refuse that), with the version counter shared as without the node;
        # gradients of unused ones stay None rather than zeros (``set_materialize_grads(False)``)
        ctx.target, ctx.materialize_grads = target, False
        return tensors[0].detach() if len(tensors) == 1 else tuple([t.detach() for t in tensors])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # the autograd graph, which outlives a step when a user keeps a loss, holds the schedule
        # weakly, so it never keeps the engine, the module and the Trainer alive
        ref, method, index = ctx.target
        schedule = ref()
        if schedule is not None:
            method(schedule, schedule.units[index])
        return (None, *grads)


_apply_in_cpp = torch._C._FunctionBase.__dict__["apply"].__get__(None, _UnitBoundary)
"""``_UnitBoundary.apply`` without ``Function.apply``'s Python layer, which binds default arguments
(the boundary has none and no ``setup_context``) and unwraps functorch's dead wrappers before
calling this very C++ method: 6 Python calls a boundary, two boundaries a unit call (issue 60).
Used while no functorch transform is active (``_boundary``), as ``Function.apply`` itself does."""


def _boundary(target: "_Target", *tensors: torch.Tensor) -> Any:
    if torch._C._are_functorch_transforms_active():
        return _UnitBoundary.apply(target, *tensors)
    return _apply_in_cpp(target, *tensors)


_Target = tuple
"""``(weakref to the schedule, method, unit index)``: what a boundary's backward calls, one tuple per
unit and method, made once (``Function.apply`` costs a Python call per argument it is given)."""


_LEAVES = (torch.Tensor, int, float, bool, str)


def _through(target: _Target, tree: Any) -> tuple[Any, bool]:
    """``tree`` with its tensors that need a gradient passed through a :class:`_UnitBoundary` calling
    ``target`` (one node for all of them), and whether there were any. A tensor, or a tuple or list of tensors and other values,
    is handled as it is; anything else (dicts, nested structures) is flattened."""
    if isinstance(tree, torch.Tensor):
        if not tree.requires_grad:
            return tree, False
        return _boundary(target, tree), True
    if isinstance(tree, (tuple, list)) and all([v is None or isinstance(v, _LEAVES) for v in tree]):
        leaves, rebuild = list(tree), lambda new: type(tree)(new) if type(tree) in (tuple, list) else type(tree)(*new)
    else:
        leaves, spec = tree_flatten(tree)
        rebuild = lambda new: tree_unflatten(new, spec)  # noqa: E731
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions:
        return tree, False
    passed = _boundary(target, *[leaves[i] for i in positions])
    for i, t in zip(positions, passed if len(positions) > 1 else (passed,)):
        leaves[i] = t
    return rebuild(leaves), True


class GatherSchedule:
    """Registers and runs the stage-3 hooks for ``units`` (the root first)."""

    def __init__(self, units: Sequence[Unit], prefetch_units: int, kept_frozen_bytes: float = 0) -> None:
        self.units = list(units)
        self.root = self.units[0]
        self.prefetch_units = prefetch_units
        self.kept = KeptFrozenUnits(self.units, kept_frozen_bytes)
        self._kept_indices = self.kept.indices  # looked up at every free
        self._hooks = ModuleHooks()  # left out of pickles and copies of the modules (module_hooks.py)
        self._forward_order: list[int] = []  # unit indices in the order their forward ran
        self._previous_order: list[int] = []
        # What ends each unit's backward; filled by its forward calls, cleared by each backward's end
        # (manual optimization runs several backwards per step):
        self._backward_calls_pending: dict[int, int] = {}  # calls with an input that needs a gradient
        self._grads_pending: dict[int, set[int]] = {}  # for a call without one: its trainable parameters
        self.awaiting = self._grads_pending  # ReduceDuringBackward's GradientListener: calls only while not empty
        # the backward gather queue (see [Note: backward gather order]):
        self._called_with_grad: list[int] = []  # units whose forward output needs a gradient, in call order
        self._backward_queue: Optional[list[Unit]] = None  # made at this backward's first gradient hook
        self._queue_position: dict[int, int] = {}
        self._issued = 0  # queue entries whose gather has been issued
        self._unit_of: dict[int, Unit] = {id(p): unit for unit in self.units[1:] for p in unit.params}
        self._ref = weakref.ref(self)
        self._inputs_with_grad: list[bool] = []  # per unit call in progress (nested calls stack)
        self.root_unit = self.root.index  # the gradient sync's GradientListener
        self.unit_backward_ended: Optional[Callable[[int], None]] = None
        """Set by the gradient sync: told of each unit's end of backward (see [Note: readiness per
        unit] in ``gradients/unit_readiness.py``)."""
        self.open()

    def open(self) -> None:
        """Register the units' module hooks (at construction, and again when a module kept sharded
        after ``fit`` is used again; a no-op while they are registered)."""
        if self._hooks:
            return
        for unit in self.units[1:]:
            self._hooks.add_forward_pre(unit.module, self._pre_forward(unit), with_kwargs=True)
            self._hooks.add_forward(unit.module, self._post_forward(unit), with_kwargs=True)
            HOST_WORK.hook_registrations += 2

    # ---- step boundaries -----------------------------------------------------------------------
    def begin_step(self, evaluation: bool = False) -> None:
        self.kept.begin(training=not evaluation)
        if self._forward_order:
            self._previous_order = self._forward_order
        self._forward_order = []
        self._inputs_with_grad.clear()  # a forward that raised may have left calls open
        self._forget_backward()
        for index in self._previous_order[: 1 + self.prefetch_units]:  # their reads overlap the root's
            self.units[index].read_ahead()
        self.root.unshard(GatherKind.FORWARD)

    def end_backward(self) -> None:
        for unit in self.units[1:]:
            self._free(unit)
        self._forget_backward()

    def _free(self, unit: Unit) -> None:
        """``unit``'s use in this step is over: free it, unless it is kept until the optimizer step,
        and its secondary shards (hpZ) either way."""
        if unit.secondaries is not None:  # hpZ only: no Python call per free without it
            unit.drop_secondary()
        if unit.index not in self._kept_indices:
            unit.reshard()

    def finish_backward_gathers(self) -> None:
        """Gather (and free) the units this rank's backward never reached, in queue order, so that
        peers whose backward does reach them are not left waiting (see [Note: backward gather
        order]). Called after backward, before its gradients are reduced."""
        queue = self._queue()
        while self._issued < len(queue):
            unit = queue[self._issued]
            self._issued += 1
            if unit.state is UnitState.SHARDED:
                unit.unshard(GatherKind.BACKWARD)
                unit.reshard()

    def _forget_backward(self) -> None:
        self._backward_calls_pending.clear()
        self._grads_pending.clear()
        self._called_with_grad.clear()
        self._backward_queue, self._queue_position, self._issued = None, {}, 0

    def end_step(self, before_optimizer_step: bool = True) -> None:
        """After a step's backward (or an evaluation step): free every unit, but those kept while
        the step only accumulated (``before_optimizer_step`` False)."""
        if before_optimizer_step:
            self.kept.release()
        for unit in self.units:
            self._free(unit)

    def replay_evaluation_step(self) -> None:
        """Issue the gathers of an evaluation step without running it: those of this rank's last
        step, in its forward order (a rank out of batches shadowing its peers, see
        ``evaluation_join.py``)."""
        order = self._forward_order or self._previous_order or [unit.index for unit in self.units[1:]]
        self.root.unshard(GatherKind.FORWARD)
        for index in order:  # as the peers' evaluation gathers: quantized alike with qwZ
            self.units[index].unshard(GatherKind.FORWARD)
            self._free(self.units[index])
        self.root.reshard()

    def refresh_gathered(self) -> None:
        """After an optimizer step: gathered units hold stale weights; gather them anew (kept
        frozen units are freed: the next step gathers them again)."""
        self.kept.release()
        for unit in self.units:
            if unit.state is not UnitState.SHARDED:
                unit.regather()

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit):
        ends: _Target = (self._ref, GatherSchedule._call_backward_ended, unit.index)
        kept = self.kept

        def eager(module: Any, args: Any, kwargs: Any) -> Any:
            if self._backward_queue is None:  # a forward: hpZ keeps the secondary shards for backward
                kind = GatherKind.FORWARD
                unit.unshard(kind, keep_secondary=torch.is_grad_enabled())
            else:  # a recompute in backward (activation checkpointing)
                kind = GatherKind.BACKWARD
                unit.unshard(kind)
            if kept.keeping:
                kept.used(unit)
                if unit.secondaries is not None and unit.index in self._kept_indices:
                    unit.drop_secondary()  # kept gathered until the optimizer step: backward gathers it no more
            self._forward_order.append(unit.index)
            self._prefetch_after(unit.index, len(self._forward_order) - 1, kind)
            if not torch.is_grad_enabled():
                return None
            args, with_grad = _through(ends, args)
            if kwargs:
                kwargs, kwargs_with_grad = _through(ends, kwargs)
                with_grad = with_grad or kwargs_with_grad
            self._inputs_with_grad.append(with_grad)  # read by this call's post-hook
            if not with_grad:
                return None
            self._backward_calls_pending[unit.index] = self._backward_calls_pending.get(unit.index, 0) + 1
            return args, kwargs

        return torch._dynamo.disable(eager)  # see [Note: gathers under torch.compile]

    def _post_forward(self, unit: Unit):
        begins: _Target = (self._ref, GatherSchedule._pre_backward, unit.index)
        kept_indices = self._kept_indices

        def eager(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            if unit.index not in kept_indices:
                unit.reshard()
            if not torch.is_grad_enabled():
                return None
            inputs_with_grad = self._inputs_with_grad.pop() if self._inputs_with_grad else False
            output, with_grad = _through(begins, output)
            if not with_grad:  # backward will not gather it for this call
                unit.drop_secondary()
                return None
            self._called_with_grad.append(unit.index)
            if not inputs_with_grad:  # the last parameter gradient ends this call's backward
                self._grads_pending[unit.index] = {id(p) for p in unit.params if p.param.requires_grad}
            return output

        return torch._dynamo.disable(eager)  # see [Note: gathers under torch.compile]

    def _call_backward_ended(self, unit: Unit) -> None:
        remaining = self._backward_calls_pending.get(unit.index, 1) - 1
        self._backward_calls_pending[unit.index] = remaining
        if remaining <= 0 and not self._grads_pending.get(unit.index):
            if self.unit_backward_ended is not None:
                self.unit_backward_ended(unit.index)  # its gradients are in: its buckets may launch
            self._free(unit)

    def _pre_backward(self, unit: Unit) -> None:
        queue = self._queue()
        position = self._queue_position.get(unit.index)
        freed_after_its_turn = position is not None and position < self._issued and unit.state is UnitState.SHARDED
        if position is None or freed_after_its_turn:  # not queued, or reached again: on demand
            unit.unshard(GatherKind.BACKWARD)
            return
        self._issue_through(queue, position)
        unit.unshard(GatherKind.BACKWARD)
        self._issue_through(queue, position + self.prefetch_units)
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

    def _issue_through(self, queue: list[Unit], position: int) -> None:
        """Issue the gathers of ``queue`` (this backward's) up to ``position``."""
        while self._issued <= min(position, len(queue) - 1):
            queue[self._issued].start_unshard(GatherKind.BACKWARD)
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
            self._free(unit)

    def _prefetch_after(self, index: int, position: int, kind: GatherKind) -> None:
        order = self._previous_order
        if self.prefetch_units <= 0 or position + 1 >= len(order) or order[position] != index:
            return  # no record yet, or this forward already left last step's path
        for later in order[position + 1 : position + 1 + self.prefetch_units]:
            self.units[later].start_unshard(kind)
        for later in order[position + 1 + self.prefetch_units : position + 2 + self.prefetch_units]:
            self.units[later].read_ahead()

    def close(self) -> None:
        self.kept.release()
        self._hooks.remove()


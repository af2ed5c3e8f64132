"""Which parameters a backward cannot reach, known at its first gradient hook.

[Note: unreached parameters]
Buckets are reduced in one fixed order on every rank (see ``grad_sync.py``). A rank whose backward
never reaches some parameters (a unit whose output it detached, a branch it did not take) would
leave their buckets unready until the flush after its backward, and every later bucket behind them:
its peers, having launched those buckets during their backward, would then have a reduce-scatter in
flight that this rank joins only after its backward — on NCCL a kernel spinning on the peers' reduce
stream meanwhile, which any device-wide sync there (the allocator's retry after an out-of-memory
``cudaFree``, a user's ``torch.cuda.synchronize()``) turns into a hang of both ranks.

So at a backward's first gradient hook the engine asks autograd which parameters' accumulation
nodes this backward will run (``torch._C._will_engine_execute_node``, the query torch's own
``register_multi_grad_hook`` makes: a lookup in the graph task's node set, which autograd computed
when the backward started), and marks the others ready at once: they contribute zeros and a 0 used
flag, as the flush would have made them. Every rank then launches every bucket in the same order
during its backward. DDP's ``find_unused_parameters`` answers the same question by walking the graph
from the loss; here it costs one C++ lookup per parameter per backward and no Python call each.

The answer cannot be trusted where a backward nests others: reentrant activation checkpointing
(``checkpoint(..., use_reentrant=True)``) runs its region's forward without recording it, so the
outer backward's graph does not contain that region's parameters, whose gradients then arrive from
a backward of its own (the reason DDP's ``find_unused_parameters`` refuses reentrant checkpointing).
So the engine watches which graph task each gradient hook runs in: a backward in which hooks ran in
more than one task turns the marking off from then on; it is on from the second backward whose hooks
all ran in one (the first backward only learns).

[Note: accumulation nodes replaced]
The node asked about must be the one this backward runs. torch replaces a parameter's
``AccumulateGrad`` when its ``.data`` is assigned a tensor of another dtype or device
(``VariableHooks::set_data``): the next forward makes a new one, and the one held here is in no
graph again, so every later backward would find those parameters "unreached", reduce their buckets
without their gradients, and then receive them (issue 59, N1: ``summon_full_params(offload_to_cpu=True)``
lends host copies on a GPU). So the nodes are taken again at a backward's first hook where

- the engine made such an assignment since they were taken (``data_swaps()``: lending full copies
  and ending the loan, one counter compared per backward); or
- the node held for the parameter whose hook is running is not in this backward (its hook runs, so
  its node is: an assignment the engine did not make, such as ``model.to(dtype)`` round trips).

A parameter is then reached where either its old node or its new one is in the graph: a graph
recorded before the assignment still runs the old one. What neither check sees — another
parameter's ``.data`` swapped behind the engine's back, or a nested backward in a backward trusted
so far — shows as a gradient reaching a parameter marked in the same backward (a gradient pre-hook
registered on each one marked, for that backward only: nothing where none is): the next backward
only learns again, and where that parameter's bucket was already reduced without it the backward raises, naming the
causes; otherwise its gradient is in ``param.grad`` before the bucket's launch reads it, which is
exact (``ReduceDuringBackward._reached_after_all``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_zero.engine.shards.sharded_param import ShardedParam, data_swaps


class UnreachedParameters:
    """The accumulation node of each of ``params`` (kept, so autograd keeps using the same one), and
    which of them the running backward will not reach, where that can be trusted."""

    def __init__(self, params: Sequence[ShardedParam]) -> None:
        self._params = list(params)
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._nodes = [_accumulation_node(p) for p in self._params]
        self._swaps_seen = data_swaps()  # see [Note: accumulation nodes replaced]
        self.task = -1
        """The graph task of this backward's first gradient hook (-1 before it): a hook compares
        ``torch._C._current_graph_task_id()`` with it and calls ``seen_task`` when they differ."""
        self._nested = False  # this backward's hooks ran in more than one graph task
        self._trusted = False  # the last backward's did not (and there was one)

    def seen_task(self, task: int, hooked: Optional[ShardedParam]) -> list[ShardedParam]:
        """A gradient hook (of ``hooked``) ran in graph ``task``, not ``self.task``: at a backward's
        first hook, the parameters that backward will not reach (none where nesting was seen);
        later, a nested one. ``hooked`` may also be a parameter whose gradient this backward
        accumulated before a unit's end (see [Note: readiness per unit] in ``unit_readiness.py``):
        where its node is not in the backward running that end, a nested backward accumulated it
        (reentrant checkpointing), and nothing is marked. None (no gradient came yet): nothing is
        marked, and nothing learned."""
        if self.task != -1:
            self._nested = True
            return []
        self.task = task
        if not self._trusted:
            return []
        will_run = torch._C._will_engine_execute_node
        if hooked is None:
            return []
        position = self._position[id(hooked)]
        if self._swaps_seen != data_swaps() or not will_run(self._nodes[position]):
            unreached = self._take_nodes_again()
            if not will_run(self._nodes[position]):  # its gradient came from a backward nested in this one
                self._nested = True
                return []
            return unreached
        return [p for p, node in zip(self._params, self._nodes) if not will_run(node)]

    def _take_nodes_again(self) -> list[ShardedParam]:
        """The live nodes replace the held ones; unreached: neither is in this backward (see [Note:
        accumulation nodes replaced])."""
        will_run = torch._C._will_engine_execute_node
        live = [_accumulation_node(p) for p in self._params]
        unreached = [p for p, old, new in zip(self._params, self._nodes, live) if not (will_run(old) or will_run(new))]
        self._nodes = live
        self._swaps_seen = data_swaps()
        return unreached

    def reached_after_all(self) -> None:
        """A parameter marked in this backward received its gradient: the next backward only learns,
        and the first trusted one after it takes the nodes again."""
        self._nested = True
        self._swaps_seen = -1

    @property
    def nested(self) -> bool:
        """Whether the running backward has shown a nested one so far."""
        return self._nested

    @property
    def trusted(self) -> bool:
        """Whether the running backward marks what it will not reach: every rank then launches every
        bucket during its backward (what the reduce stream's bound needs, see [Note: reduce stream])."""
        return self._trusted

    def backward_ended(self) -> None:
        if self.task != -1:
            self._trusted = not self._nested
        self.task, self._nested = -1, False


def _accumulation_node(p: ShardedParam) -> Any:
    """``p.param``'s ``AccumulateGrad`` node (a stage-3 parameter at rest included: a view is only
    metadata); made if the parameter has none now."""
    with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():
        return p.param.view_as(p.param).grad_fn.next_functions[0][0]

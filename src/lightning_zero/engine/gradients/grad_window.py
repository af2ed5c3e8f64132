"""When ``param.grad`` shows the reduced gradients, and how edits to it reach the optimizer.

The window opens when a backward's gradients are reduced (``ZeroEngine.finish_backward``) and,
as ``param.grad`` under DDP, stays open past the optimizer step until ``optimizer.zero_grad()``
(``released``: the optimizer frees or zeroes the chunks, so the views go or show zeros) or the next
step's backward (``close``). While it is open every trainable parameter with a gradient has a
:class:`ShardedGradient` in ``.grad`` (see [Note: gradients where users look] in
``sharded_grad.py``); it holds nothing itself, so keeping it open costs no memory beyond the
chunks the optimizer kept anyway:

- in-place edits through it edit ``shard.grad`` itself, so they need no further step;
- an assignment (``p.grad = None``, ``p.grad = p.grad * mask``, ``p.grad = tensor``) is taken by
  ``take_assignments`` right before the optimizer steps: None drops that gradient, as under DDP
  (the optimizer skips the parameter), a tensor becomes it (this rank keeps its chunk); one made
  after the step (``model.zero_grad()``) is taken before the next backward, which accumulates into
  what it left, as under DDP;
- on a micro-batch that only accumulates (stages 2-3), DDP would show this rank's own unreduced
  gradient, which no rank holds here: reading it fails and says to read gradients after the last
  micro-batch. (Stage 1 keeps full unreduced gradients until the last micro-batch, as DDP does.)

Installing a view is one attribute assignment per parameter (under
``DisableTorchFunctionSubclass``, so a stage-3 parameter at rest takes it without a Python call);
nothing is computed until user code reads ``.grad``.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.chunk_gather import all_gather_chunks
from lightning_zero.engine.gradients.sharded_grad import ShardedGradient
from lightning_zero.engine.shards.sharded_param import ShardedParam


class WindowState(enum.Enum):
    CLOSED = "closed"
    REDUCED = "reduced"
    """After the backward of a micro-batch that steps: the gradients are whole."""
    ACCUMULATING = "accumulating"
    """After the backward of a micro-batch that only accumulates (stages 2-3)."""


class GradientWindow:
    """Shows ``params``' gradient shards as their full gradients in ``param.grad``."""

    def __init__(self, params: Sequence[ShardedParam], group: collectives.ProcessGroup) -> None:
        self._params = [p for p in params if p.shard.requires_grad]
        self._group = group
        self._views: dict[int, ShardedGradient] = {}
        self._shown: list[ShardedParam] = []
        self.state = WindowState.CLOSED

    def open(self, reduced: bool) -> None:
        """After a backward: ``reduced`` when its gradients were reduced into the shards."""
        self.close()
        self.state = WindowState.REDUCED if reduced else WindowState.ACCUMULATING
        views = self._views
        with torch._C.DisableTorchFunctionSubclass():  # see the module's docstring
            for p in self._params:
                if p.shard.grad is not None:
                    p.param.grad = views[id(p)] if id(p) in views else self._view_of(p)
                    self._shown.append(p)

    @property
    def reduced(self) -> Optional[frozenset[int]]:
        """The ``id``s of the ``ShardedParam``s the last backward's reduction gave a gradient, the
        same on every rank (the reduced used flags decided them, see [Note: used flags] in
        ``bucket.py``), whatever was assigned to ``.grad`` since; None while the window is not open
        on reduced gradients."""
        if self.state is not WindowState.REDUCED:
            return None
        return frozenset(id(p) for p in self._shown)

    def show_again(self) -> None:
        """After something else held ``param.grad`` for a while (``summon_full_params(with_grads=True)``
        inside the window): the views again."""
        for p in self._shown:
            p.show_grad(self._views[id(p)] if p.shard.grad is not None else None)

    def released(self) -> None:
        """After ``optimizer.zero_grad()`` (or a step that freed chunks): a parameter whose chunk is
        gone shows None, as under DDP; a zeroed chunk (``set_to_none=False``) shows zeros as it is."""
        views = self._views
        with torch._C.DisableTorchFunctionSubclass():  # at rest, no Python call per parameter
            for p in self._shown:
                if p.shard.grad is None and p.param.grad is views[id(p)]:
                    p.param.grad = None

    def close(self, before_backward: bool = False) -> None:
        """``.grad`` is None again. ``before_backward`` (the next backward follows, nothing has
        accumulated since the window opened): gradients user code assigned or dropped meanwhile
        become the chunks that backward accumulates into (``take_assignments``)."""
        if before_backward:
            self.take_assignments()
        views = self._views
        with torch._C.DisableTorchFunctionSubclass():
            for p in self._shown:
                if p.param.grad is views[id(p)]:  # not what a backward accumulated since (sharded_grad.py)
                    p.param.grad = None
        self._shown.clear()
        self.state = WindowState.CLOSED

    def take_assignments(self) -> None:
        """Right before the optimizer steps: gradients assigned while the window was open replace
        (or, assigned None, drop) the shards' gradients."""
        if self.state is not WindowState.REDUCED:
            return
        for p in self._shown:
            view = self._views[id(p)]
            with torch._C.DisableTorchFunctionSubclass():  # at rest, no Python call per parameter
                shown = p.param.grad
            if shown is view:
                continue
            if shown is None:
                p.shard.grad = None
            else:
                p.shard.grad = _chunk_of_assigned(p, shown)
                p.show_grad(view)

    def _view_of(self, p: ShardedParam) -> ShardedGradient:
        view = self._views.get(id(p))
        if view is None:
            view = ShardedGradient(
                p.shape, p.param.dtype, p.device, lambda: self._chunk(p), p.layout.owned_range(p.rank), self._group, p.name, p.param,
                edited=lambda: _mark_edited(p.shard.grad),
            )  # fmt: skip
            self._views[id(p)] = view
        return view

    def _chunk(self, p: ShardedParam) -> Tensor:
        if self.state is WindowState.ACCUMULATING:
            raise RuntimeError(
                f"The gradient of parameter {p.name!r} was read after the backward of a micro-batch that only"
                " accumulates (`accumulate_grad_batches`, `no_backward_sync`). There DDP shows this rank's own"
                " unreduced gradient, which ZeRO stages 2-3 never hold: each micro-batch is reduced into the"
                " shards. HINT: read gradients after the last micro-batch's backward (e.g. in"
                " `on_before_optimizer_step`), where they are whole."
            )
        grad = p.shard.grad
        if grad is None:
            raise RuntimeError(
                f"The gradient of parameter {p.name!r} was read after it was released (`optimizer.zero_grad()`"
                " ran after the backward). Read gradients between the backward and the optimizer step."
            )
        return grad.detach().view(-1)


def _mark_edited(grad: Optional[Tensor]) -> None:
    """Move ``grad``'s version counter, as an in-place op through autograd would have."""
    if grad is not None:
        torch.autograd.graph.increment_version(grad)


def _chunk_of_assigned(p: ShardedParam, assigned: Tensor) -> Tensor:
    """This rank's chunk of a gradient assigned to ``p.param.grad``, in the shard's dtype and device."""
    if isinstance(assigned, ShardedGradient):
        if assigned.shape != p.shape or assigned._range != p.layout.owned_range(p.rank):
            raise RuntimeError(
                f"Parameter {p.name!r} was assigned the gradient of {assigned._name!r} (shape"
                f" {tuple(assigned.shape)}); a gradient must have the parameter's shape {tuple(p.shape)}."
            )
        chunk: Tensor = assigned._local()
    else:
        if assigned.shape != p.shape:
            raise RuntimeError(
                f"Parameter {p.name!r} of shape {tuple(p.shape)} was assigned a gradient of shape"
                f" {tuple(assigned.shape)}; assign a tensor of the parameter's shape, or None."
            )
        start, end = p.layout.owned_range(p.rank)
        chunk = assigned.detach().reshape(-1)[start:end]
    return chunk.to(p.shard.device, p.shard.dtype, copy=True)


def full_gradients(
    params: Sequence[ShardedParam], group: collectives.ProcessGroup, max_bytes: int, device: Optional[torch.device] = None, keep: bool = True
) -> list[Optional[Tensor]]:
    """Each parameter's full gradient (None where it has none), in its dtype and on ``device``
    (default: its own), gathered from every rank's chunk one piece of at most ``max_bytes`` at a time.
    A collective: call it on every rank with the same ``params``; ``keep=False``: take part only."""
    with_grad = [p for p in params if p.shard.grad is not None]  # the same on every rank
    if not with_grad:
        return [None] * len(params)
    targets = {
        id(p): torch.empty(p.layout.numel, dtype=p.shard.grad.dtype, device=device or p.device) if keep else None
        for p in with_grad
    }
    # staged on the compute device, where the group communicates (offloaded chunks live on the host)
    all_gather_chunks([(p.shard.grad.detach().view(-1), p.layout, targets[id(p)]) for p in with_grad], group, with_grad[0].device, max_bytes)
    full = {key: flat for key, flat in targets.items() if flat is not None}
    return [full[id(p)].view(p.shape).to(p.param.dtype) if id(p) in full else None for p in params]

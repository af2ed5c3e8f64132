"""A parameter's full gradient as one rank sees it: what ``param.grad`` holds between backward and
the optimizer step.

[Note: gradients where users look]
ZeRO keeps each gradient as chunks, one per rank (``ShardedParam.shard.grad``); the full gradient
exists on no rank. Code written for DDP still reads ``param.grad`` there: raw
``clip_grad_norm_``/``clip_grad_value_``, Lightning's ``grad_norm``, NaN checks, masks. So from the
end of backward to the optimizer step each trainable parameter's ``.grad`` is a
:class:`ShardedGradient`: a tensor with the full gradient's shape, dtype and device whose values
are this rank's chunk, read live from ``shard.grad`` (FSDP2 makes the same choice with DTensor; our
chunks are of the flattened parameter, which DTensor's ``Shard(0)`` cannot describe). Under
``__torch_dispatch__``:

- element-wise operations work on the chunk: in place (``mul_``, ``clamp_``, ``zero_``,
  ``masked_fill_``: they edit the gradient the optimizer steps) or not (their result is a
  ``ShardedGradient`` too); a full-size operand (a mask) contributes its matching chunk;
- whole-tensor reductions (``sum``, ``mean``, ``max``, ``min``, ``all``, ``any``,
  ``count_nonzero``, vector norms, ``_foreach_norm``) reduce the chunks and all-reduce the partial
  results, so they give DDP's answer on every rank. They are collectives: every rank must run
  them, as every rank runs ``clip_grad_norm_``;
- ``torch.equal`` compares the chunks and all-reduces the verdict, a collective too;
- ``torch.distributed.all_reduce`` on gradients (manual optimization written for DDP that syncs
  them itself, as Lightning's GAN tests do): every rank's ``.grad`` is the same full gradient, so
  the all-reduce of its copies multiplies each chunk by a factor: the group's size for ``SUM``, 1
  for ``AVG``, ``MAX`` and ``MIN`` (the same operation over the same group on a two-element probe
  tells it). That is DDP's result, where every rank holds the same reduced gradient too (exactly
  for two ranks; beyond, DDP's own sum rounds in its ring's order). Other operations, and a
  gradient among plain tensors, fail;
- anything else (indexing, views, reductions along a dimension, copies to another device) would
  need the whole tensor and fails, naming the parameter and ``summon_full_params(with_grads=True)``.

Nothing here runs unless user code touches ``.grad``: the step's own path reads ``shard.grad``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.comm import answered_collectives, collectives

aten = torch.ops.aten

LocalChunk = Callable[[], Tensor]
"""Returns this rank's elements of the full gradient, flat (raises when there are none to read)."""

_ALIASES = {aten.detach.default, aten.alias.default}
_ELEMENTWISE_EXTRA = {
    aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.copy_.default,
    aten.clone.default, aten.where.self, aten._to_copy.default,
}  # fmt: skip
"""Element-wise operations torch does not tag ``pointwise``."""

_REDUCTIONS: dict[Any, str] = {
    aten.sum.default: "sum", aten.mean.default: "mean", aten.max.default: "max", aten.min.default: "min",
    aten.all.default: "all", aten.any.default: "any", aten.count_nonzero.default: "count_nonzero",
    aten.linalg_vector_norm.default: "norm",
}  # fmt: skip
"""Whole-tensor reductions, by how their partial results combine across ranks."""


class ShardedGradient(torch.Tensor):
    """The full gradient of parameter ``name`` (``shape``), of which this rank holds the flat
    elements ``[start, end)``; see [Note: gradients where users look]."""

    _local: LocalChunk
    _range: tuple[int, int]
    _group: collectives.ProcessGroup
    _name: str
    _param: Optional[weakref.ref]
    """The parameter whose ``.grad`` this is (None: a result computed from one)."""
    _edited: Optional[Callable[[], None]]
    """Told after an in-place edit: edits made here, below autograd, move no version counter, and
    the host step taken during backward tells an edited gradient by its chunk's (``step_ahead.py``)."""

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        local: LocalChunk,
        owned_range: tuple[int, int],
        group: collectives.ProcessGroup,
        name: str,
        param: Optional[Tensor] = None,
        edited: Optional[Callable[[], None]] = None,
    ) -> "ShardedGradient":
        grad = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        grad._local, grad._range, grad._group, grad._name = local, owned_range, group, name
        grad._param = weakref.ref(param) if param is not None else None
        grad._edited = edited
        return grad

    def _like(self, local: LocalChunk, dtype: torch.dtype) -> "ShardedGradient":
        """A result computed from this gradient (a tensor of its own: edits to it edit nothing)."""
        return ShardedGradient(self.shape, dtype, self.device, local, self._range, self._group, self._name)

    def _alias(self) -> "ShardedGradient":
        """``.data``, ``.detach()``, ``alias``: the same chunk, so an in-place edit through the alias
        is an edit of this gradient and tells what this one tells (``_edited``)."""
        return ShardedGradient(self.shape, self.dtype, self.device, self._local, self._range, self._group, self._name, edited=self._edited)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # printing reads values: never a collective
        start, end = self._range
        return (
            f"ShardedGradient({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype}: this rank holds"
            f" elements [{start}, {end}) of the flattened gradient)"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(unsupported_message(self._name, "pickle"))

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(unsupported_message(self._name, "numpy"))

    def tolist(self) -> Any:
        raise RuntimeError(unsupported_message(self._name, "tolist"))

    def item(self) -> Any:
        raise RuntimeError(unsupported_message(self._name, "item"))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(unsupported_message(self._name, "numpy.asarray"))

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(unsupported_message(self._name, "copy.deepcopy"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        sharded = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ShardedGradient)]
        first = sharded[0]
        if torch._C._current_graph_task_id() != -1:
            return _accumulate_in_backward(func, first, args)
        if func in _ALIASES:
            return first._alias()
        if func is answered_collectives.ALL_REDUCE_OP:
            return _all_reduce_copies(args, kwargs)
        if func is aten.equal.default:
            return _equal(first, args)
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_"):
            return _foreach(func, name[len("_foreach_"):], args, kwargs)
        if func in _REDUCTIONS:
            return _reduce(func, _REDUCTIONS[func], first, args, kwargs)
        if torch.Tag.pointwise in func.tags or func in _ELEMENTWISE_EXTRA:
            return _elementwise(func, first, sharded, args, kwargs)
        raise RuntimeError(unsupported_message(first._name, name))


def _accumulate_in_backward(func: Any, view: ShardedGradient, args: tuple) -> Any:
    """Autograd accumulating a new gradient into a parameter whose ``.grad`` shows the view: a
    second backward in one step, with no ``engine.before_backward()`` between (a plain loop). The
    view's values are in the shards already, so the new gradient alone becomes ``.grad`` and takes
    the usual way into them (``+=`` replaces it on the parameter; ``+`` returns it)."""
    param = view._param() if view._param is not None else None
    new = args[1] if len(args) > 1 else None
    if param is None or args[0] is not view or not isinstance(new, Tensor) or isinstance(new, ShardedGradient):
        raise RuntimeError(
            f"`{func.overloadpacket.__name__}` on the gradient of parameter {view._name!r} inside a backward pass:"
            " lightning-zero's view of the reduced gradient cannot take part in autograd. HINT: read"
            " `.grad` between the backward and the optimizer step."
        )
    fresh = new.detach().clone()
    if func is aten.add_.Tensor:
        param.grad = fresh
        return view
    if func is aten.add.Tensor:
        return fresh
    raise RuntimeError(unsupported_message(view._name, f"{func.overloadpacket.__name__} in a backward pass"))


def unsupported_message(name: str, operation: str) -> str:
    return (
        f"`{operation}` on the gradient of parameter {name!r}: lightning-zero holds only this rank's chunk"
        " of it (ZeRO shards gradients), and this operation needs the whole tensor. Element-wise operations"
        " (in place or not, also with full-size tensors such as masks) and whole-tensor reductions (sum, mean,"
        " max, min, all, any, count_nonzero, norms), `torch.equal` and `torch.distributed.all_reduce` (sum, avg, max,"
        " min) give DDP's answers; the reductions communicate, so run"
        " them on every rank. HINT: for anything else, read the full gradients inside"
        " `with trainer.strategy.summon_full_params(with_grads=True):` (entered on every rank)."
    )


# ---- element-wise ------------------------------------------------------------------------------
def _elementwise(func: Any, first: ShardedGradient, sharded: Sequence[ShardedGradient], args: tuple, kwargs: dict) -> Any:
    for other in sharded:
        if other.shape != first.shape or other._range != first._range or other._group is not first._group:
            raise RuntimeError(unsupported_message(first._name, f"{func.overloadpacket.__name__} with the gradient of {other._name!r}"))
    if "out" in kwargs:
        raise RuntimeError(unsupported_message(first._name, f"{func.overloadpacket.__name__}(out=...)"))
    try:
        result = func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs))  # torch's checks, and the result's kind
    except NotImplementedError:  # no meta kernel (`equal`): not an element-wise result we can give
        raise RuntimeError(unsupported_message(first._name, func.overloadpacket.__name__)) from None
    in_place = _mutates_first_argument(func)
    if in_place and not isinstance(args[0], ShardedGradient):
        raise RuntimeError(unsupported_message(first._name, f"{func.overloadpacket.__name__} into a plain tensor"))
    if not in_place and result.shape != first.shape:
        raise RuntimeError(unsupported_message(first._name, f"{func.overloadpacket.__name__} broadcasting to {tuple(result.shape)}"))
    if kwargs.get("device") not in (None, first.device):  # `.to(other_device)`: the chunk cannot say what lives there
        raise RuntimeError(unsupported_message(first._name, f"a copy to {kwargs['device']}"))

    def apply() -> Tensor:
        local = first._local()
        out = func(*tree_map(lambda a: _chunk_of(a, first, local), args), **tree_map(lambda a: _chunk_of(a, first, local), kwargs))
        return out if in_place else out.to(result.dtype)

    if in_place:
        apply()
        if args[0]._edited is not None:
            args[0]._edited()
        return args[0]
    computed = apply()
    return first._like(lambda: computed, result.dtype)


def _mutates_first_argument(func: Any) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _as_meta(a: Any) -> Any:
    """``a`` for running an operation on the meta device: its checks and its result's shape and dtype."""
    if isinstance(a, Tensor):  # a ShardedGradient too: its full shape and dtype
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


def _chunk_of(a: Any, like: ShardedGradient, local: Tensor) -> Any:
    """``a`` as the operand of this rank's chunk: a gradient's own chunk, a full-size (or
    broadcastable) tensor's matching elements, a scalar as it is."""
    if isinstance(a, ShardedGradient):
        return a._local() if a is not like else local
    if isinstance(a, Tensor):
        if a.dim() == 0:
            return a if a.device == local.device or a.device.type == "cpu" else a.to(local.device)
        start, end = like._range
        return a.expand(like.shape).reshape(-1)[start:end].to(local.device)
    if isinstance(a, torch.device):
        return local.device
    return a


# ---- collectives and comparisons ---------------------------------------------------------------
def _all_reduce_copies(args: tuple, kwargs: dict) -> tuple[list[Tensor], Any]:
    """``torch.distributed.all_reduce`` of gradients, answered from this rank's chunks (see the
    module's note): every rank's ``.grad`` is the same full gradient."""
    tensors = args[0]
    sharded = [t for t in tensors if isinstance(t, ShardedGradient)]
    if len(sharded) != len(tensors):
        raise RuntimeError(unsupported_message(sharded[0]._name, "all_reduce with plain tensors"))
    factor = answered_collectives.all_reduce_factor(args, kwargs, sharded[0].device)
    if factor is None:
        raise RuntimeError(unsupported_message(sharded[0]._name, "all_reduce with an operation other than sum, avg, max or min"))
    if factor != 1.0:  # SUM: the group's size times the gradient; AVG, MAX, MIN leave it as it is
        for grad in sharded:
            grad._local().mul_(factor)
            if grad._edited is not None:
                grad._edited()
    return tensors, answered_collectives.finished_work(tensors)


def _equal(first: ShardedGradient, args: tuple) -> bool:
    """``torch.equal`` with a gradient: the same verdict on every rank (a collective)."""
    a, b = args[0], args[1]
    for other in (a, b):
        if isinstance(other, ShardedGradient) and (other._range != first._range or other._group is not first._group):
            raise RuntimeError(unsupported_message(first._name, f"equal with the gradient of {other._name!r}"))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False  # every rank sees the same shapes and dtypes
    local = first._local()
    same = torch.equal(_chunk_of(a, first, local), _chunk_of(b, first, local))
    verdict = torch.tensor([int(same)], device=first.device)
    return bool(collectives.all_reduce(verdict, first._group, op="min").item())


# ---- reductions --------------------------------------------------------------------------------
def _reduce(func: Any, kind: str, grad: ShardedGradient, args: tuple, kwargs: dict) -> Tensor:
    if grad is not args[0]:
        raise RuntimeError(unsupported_message(grad._name, f"{func.overloadpacket.__name__} with it as an argument"))
    order = _norm_order(args, kwargs) if kind == "norm" else None
    result = func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs))
    if result.dim() != 0:
        raise RuntimeError(unsupported_message(grad._name, f"{func.overloadpacket.__name__} along a dimension"))
    [value] = _reduce_many([(grad, kind, order)])
    return value.to(result.dtype)


def _norm_order(args: tuple, kwargs: dict) -> float:
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None:
        return float("nan")  # refused by the dimension check
    return float(order)


def _reduce_many(requests: Sequence[tuple[ShardedGradient, str, Optional[float]]]) -> list[Tensor]:
    """Each gradient's reduction, from its chunk's partial result, with one all-reduce per way of
    combining (sum, max, min) for all of them."""
    partials = [_partial(grad._local(), kind, order) for grad, kind, order in requests]
    combined: list[Optional[Tensor]] = [None] * len(requests)
    for op in ("sum", "max", "min"):
        indices = [i for i, (_, combine, _) in enumerate(partials) if combine == op]
        if indices:
            first = requests[indices[0]][0]
            # on the parameters' device, where the group communicates (offloaded chunks live on the host)
            stacked = torch.stack([partials[i][0].to(first.device, torch.float64) for i in indices])
            group = first._group
            collectives.all_reduce(stacked, group, op=op)
            for i, value in zip(indices, stacked.unbind(0)):
                combined[i] = value
    return [
        _finish(value, kind, order, grad).to(grad.device)  # type: ignore[arg-type]
        for value, (grad, kind, order) in zip(combined, requests)
    ]


def _partial(local: Tensor, kind: str, order: Optional[float]) -> tuple[Tensor, str, None]:
    """This rank's contribution and how contributions combine ("sum", "max" or "min")."""
    empty = local.numel() == 0
    if kind in ("sum", "mean"):
        return local.sum(dtype=torch.float64 if local.is_floating_point() else torch.int64), "sum", None
    if kind == "count_nonzero":
        return torch.count_nonzero(local), "sum", None
    if kind in ("max", "min"):
        identity = float("-inf") if kind == "max" else float("inf")
        return (torch.tensor(identity) if empty else getattr(local, kind)()), kind, None
    if kind in ("all", "any"):
        return (torch.tensor(kind == "all") if empty else getattr(local, kind)()).to(torch.int64), "min" if kind == "all" else "max", None
    assert order is not None
    if order == float("inf"):
        return (torch.tensor(0.0) if empty else local.abs().max()), "max", None
    if order == float("-inf"):
        return (torch.tensor(float("inf")) if empty else local.abs().min()), "min", None
    if order == 0:
        return torch.count_nonzero(local), "sum", None
    return local.abs().to(torch.float64).pow(order).sum(), "sum", None


def _finish(value: Tensor, kind: str, order: Optional[float], grad: ShardedGradient) -> Tensor:
    if kind == "mean":
        return value / grad.numel()
    if kind in ("all", "any"):
        return value.to(torch.bool)
    if kind == "norm" and order not in (0.0, float("inf"), float("-inf")):
        return value.pow(1.0 / order)
    return value


# ---- foreach kernels ---------------------------------------------------------------------------
def _foreach(func: Any, op_name: str, args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_*`` over gradients: norms in one all-reduce, anything else tensor by tensor."""
    tensors = args[0]
    if op_name == "norm":
        order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
        if kwargs.get("dtype") is not None or not all(isinstance(t, ShardedGradient) for t in tensors):
            return [torch.linalg.vector_norm(t, order, dtype=kwargs.get("dtype")) for t in tensors]
        return [v.to(t.dtype) for v, t in zip(_reduce_many([(t, "norm", order) for t in tensors]), tensors)]
    single = getattr(aten, op_name)
    results = []
    for i in range(len(tensors)):
        pick = lambda a: a[i] if isinstance(a, (list, tuple)) and len(a) == len(tensors) else a  # noqa: E731
        results.append(single(*[pick(a) for a in args], **{k: pick(v) for k, v in kwargs.items()}))
    return None if _mutates_first_argument(func) else results

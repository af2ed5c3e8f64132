"""A stage-3 parameter at rest: reads gather its values collectively, writes reach this rank's chunk.

[Note: parameters at rest]
Between its unit's uses a stage-3 parameter is a view of a storage shrunk to 0 bytes (see [Note:
stage-3 storage] in ``gathered_storage.py``), with its true shape. Code that reads it then would
read freed memory, so while at rest the parameter's class is :class:`ParameterAtRest`, whose
``__torch_function__`` lets through what describes the tensor (shape, dtype, device,
``requires_grad``, ``grad``, ``numel``, hooks) and sees every other use of its values. Gathering
puts the parameter's own class back, so a unit's forward and backward pay nothing for this: while
gathered it is exactly an ``nn.Parameter``, as Dynamo and torch's fast paths expect. The switch is
one ``__class__`` assignment per parameter in a loop over the unit (no Python call; 51 ns per
parameter measured on the CPU); a class per unit switched once would cost less but makes Dynamo
guard on each unit's class and recompile a compiled block once per unit. The engine's own reads of
``.grad`` at rest run under ``torch._C.DisableTorchFunctionSubclass()``.

[Note: reads at rest]
A read (``clone``, ``cpu``, ``detach``, ``view``, ``numpy`` after ``detach``, ``tolist``, ``torch.equal``,
``.data``, pickling the parameter or its module, ``copy.deepcopy``) gives DDP's values: the
engine's reader for the parameter (``readers``; ``engine/parameters/reads_at_rest.py``) gathers that
one tensor across the shard group at that moment, on every rank that reads, and the operation runs
on the gathered copy, which is dropped afterwards unless the result is it. A read is a collective:
every rank of the shard group must read the same parameters in the same order, as every rank runs
the same training script; a read on some ranks only fails within the agreement timeout on each
rank that reads, naming the parameter, and reads are refused off the thread that trains the model
(see [Note: agreeing on a read] in ``reads_at_rest.py``). Results that alias the copy (``detach``,
``view``, ``.data``) are :class:`GatheredValue` s, through which a write reaches the parameter
(``gathered_value.py``, [Note: writes at rest]); under grad mode a read carries its gradient back to
the parameter (see [Note: differentiable reads at rest]). Printing a parameter at rest describes it
and never communicates.

[Note: writes at rest]
Under DDP each rank writes its replica: ``p.copy_(w)``, ``module.load_state_dict(sd)`` (which copies
into every parameter under ``torch.no_grad()``), Lightning's own reload of a checkpoint after ``fit``,
``torch.nn.init.*``, ``p.data.clamp_(-c, c)`` (WGAN's weight clipping), ``p[0] = 1``, ``out=p``. A
rank's chunk of the result is a piece of the full value each rank computes, so here the operation runs
on a full tensor of the parameter's shape and each rank keeps its chunk of the result
(``write_at_rest``; the engine's ``Writer`` for the parameter, ``ShardedParameters.write_full_value``):
in the chunk the optimizer steps (the fp32 master of a half-precision parameter, the host chunk when
offloaded) and in the one the all-gather sends, so every later gather, read, save and step sees the
written value, as DDP's do. That full tensor holds the parameter's values, gathered as for a read,
unless the operation overwrites every element without reading them (``copy_``, ``fill_``, ``zero_``,
the random fills, ``out=``, on the whole parameter: ``OVERWRITING``), when nothing is gathered. Either
way the ranks first agree, through the store as for a read, that they all write that parameter there
(a write on some ranks only, which under DDP would silently make the replicas disagree, fails on each
rank that made it, naming it). A write through a value read earlier (``d = p.data; d.mul_(2)``, or
``p.view(-1)[:2].fill_(0)``) is made on the parameter's values of now, which is what DDP's alias would
write into: the same operation on the same view of a full tensor of the current values (``as_strided``
over the copy's layout); the copy the value aliases is then updated too, so it reads what was written.
Every write costs what a read costs (a store round trip, a gather unless ``OVERWRITING``) and is a
collective: every rank makes the same writes in the same order, on the training thread.

What a chunk cannot take stays refused, naming the parameter: operations that change the
parameter's storage, shape or autograd identity rather than its values (``resize_``, ``t_``,
``detach_``: ``RESHAPING``), and, as torch refuses it, an in-place write under grad mode into a
parameter that requires a gradient. ``param.data = full_tensor`` is adopted where it happens (the
engine's adopter for the parameter: each rank keeps its chunk, without agreeing; a new shape or
dtype fails there, naming both). Not seen at all: ``p.set_(t)``, which torch runs without
``__torch_function__``, and writes through numpy arrays (``p.detach().numpy()[0] = 1``), which
reach only the copy.

[Note: differentiable reads at rest]
Under DDP, ``loss + lam * sum((p ** 2).sum() for p in model.parameters())`` in a training step (L2 and
L1 penalties, EWC, orthogonality terms) differentiates through the parameters. At stage 3 every
parameter outside the root unit is at rest in the training step after the forward, so a read there
runs on a gathered copy; under grad mode, for a parameter that requires a gradient, the copy is
handed to the operation through :class:`_ReadAtRest`, an identity from the parameter itself to the
copy. Its backward returns the gradient to the parameter's own ``AccumulateGrad``, which autograd
runs once per backward with every contribution summed — the unit's forward's and the read's — as
DDP's does; its bucket then reduces the sum, as any gradient (the read comes after the unit's call
in the forward, so its backward runs before the unit's ends: see [Note: readiness per unit]). The
read costs what any read does, and autograd keeps what the operation saves (``p ** 2`` keeps the
copy) until the backward: a penalty over every parameter holds the whole model until then, as DDP
holds it anyway. (A second ``backward()`` reaching a parameter whose bucket the first one reduced
is refused as for any gradient: "received a gradient after its bucket was already reduced".)
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.shards.gathered_value import (
    GatheredValue,
    Origin,
    input_tensors,
    keep_read_only,
    origins_of,
    written_tensors,
)

DESCRIBING = frozenset(
    {
        "numel", "nelement", "dim", "size", "stride", "is_contiguous", "storage_offset", "element_size",
        "data_ptr", "untyped_storage", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "__hash__", "__len__",
    }
)  # fmt: skip
"""Tensor methods that describe a tensor without its values (property getters and setters pass too,
except ``.data``, whose getter would hand out the empty placeholder)."""


OVERWRITING = frozenset(
    {"copy_", "fill_", "zero_", "normal_", "uniform_", "constant_", "zeros_", "ones_", "_foreach_copy_", "_foreach_zero_"}
)
"""In-place operations whose result never depends on the values written over (with ``out=``, any
operation): a write covering the whole parameter needs no gather (see [Note: writes at rest])."""
RESHAPING = frozenset(
    {
        "resize_", "resize_as_", "as_strided_", "t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_",
        "unsqueeze_", "detach_", "share_memory_",
    }
)  # fmt: skip
"""In-place operations that change what the parameter is (its storage, shape or autograd identity)
rather than its values: never a write that a chunk can take."""


class Writer(Protocol):
    """How a write at rest reaches one parameter's chunk (the engine's; see [Note: writes at rest])."""

    def start(self, keep_values: bool) -> Tensor:
        """Once every rank of the shard group writes the parameter too: a full tensor of its shape and
        dtype to write into, holding its values (gathered) with ``keep_values``, else uninitialized."""

    def finish(self, full: Tensor) -> None:
        """This rank takes its chunk of ``full``, the value written."""


class ParameterAtRest(nn.Parameter):
    """The class of a stage-3 parameter while only this rank's chunk of it exists."""

    _lightning_zero_at_rest = True  # gathered_value.AT_REST_MARK: a GatheredValue leaves operations with one to this class

    names: dict[int, str] = {}
    """``id(param)`` → its name in the module, for the message (filled and emptied by the engine)."""
    adopters: dict[int, Callable[[torch.Tensor], bool]] = {}
    """``id(param)`` → what takes a tensor assigned to its ``.data``, True once it did (filled and
    emptied by the engine)."""
    readers: dict[int, Callable[[], Tensor]] = {}
    """``id(param)`` → what gathers its full value for a read (a collective; see [Note: reads at
    rest]); filled and emptied by the engine. Without one, reads are refused."""
    writers: dict[int, Writer] = {}
    """``id(param)`` → what writes its chunk (see [Note: writes at rest]); filled and emptied by
    the engine. Without one, writes are refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if _adopted(func, args):
            return None
        if _describes(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        operation = getattr(func, "__name__", str(func))
        at_rest = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, ParameterAtRest)]
        if _is_data_set(func) or any(id(p) not in cls.readers for p in at_rest):
            raise RuntimeError(cls.refusal(at_rest[0] if at_rest else None, operation))
        if any(isinstance(t, (ParameterAtRest, GatheredValue)) for t in written_tensors(func, args, kwargs)):
            return write_at_rest(func, args, kwargs)
        return _read(func, args, kwargs, at_rest)

    @staticmethod
    def refusal(param: Any, operation: str) -> str:
        """The message for ``operation`` on ``param`` (a subclass refuses for its own reason)."""
        return _message(param, operation)

    def __deepcopy__(self, memo: dict) -> Any:
        """A plain ``nn.Parameter`` with the full value, as DDP's copy (a read: a collective)."""
        copied = nn.Parameter(_full_value(self, "copy.deepcopy"), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save(model)``) as a plain ``nn.Parameter`` with the full value, which any
        process loads without lightning-zero (a read: a collective)."""
        return torch._utils._rebuild_parameter, (_full_value(self, "pickle"), self.requires_grad, OrderedDict())

    def __repr__(self) -> str:
        name = ParameterAtRest.names.get(id(self), "?")
        return f"ParameterAtRest({name!r}, shape={tuple(self.shape)}: sharded by lightning-zero stage 3, at rest)"


def _describes(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: only `.data` reads or writes values
        return getattr(getattr(func, "__self__", None), "__name__", "") != "data"
    return name in DESCRIBING or name.startswith(("is_", "_is_"))  # predicates (`is_contiguous`, `_is_view`)


def _full_value(param: "ParameterAtRest", operation: str) -> Tensor:
    reader = ParameterAtRest.readers.get(id(param))
    if reader is None:
        raise RuntimeError(type(param).refusal(param, operation))
    return reader()


def _read(func: Any, args: tuple, kwargs: Any, at_rest: list["ParameterAtRest"]) -> Any:
    """``func`` run on the full values of the parameters at rest among its arguments, each gathered
    for this read, in argument order (the same on every rank); results aliasing a gathered copy
    refuse writes (``gathered_value.py``). Under grad mode the values of parameters that require a
    gradient are differentiable (see [Note: differentiable reads at rest])."""
    params = list(dict.fromkeys(at_rest))
    copies = [ParameterAtRest.readers[id(p)]() for p in params]
    names = ", ".join(ParameterAtRest.names.get(id(p), "?") for p in params)
    with torch._C.DisableTorchFunctionSubclass():
        differentiable = torch.is_grad_enabled()
        full = {id(p): _ReadAtRest.apply(p, c) if differentiable and p.requires_grad else c for p, c in zip(params, copies)}
        swap = lambda a: full[id(a)] if isinstance(a, ParameterAtRest) else a  # noqa: E731
        result = func(*tree_map(swap, args), **tree_map(swap, kwargs or {}))
        # results aliasing a copy made here, or a value read before (an argument), stay read values
        origins = origins_of(tree_flatten((args, kwargs or {}))[0])
        origins.update({c.untyped_storage().data_ptr(): Origin(weakref.ref(p), c) for p, c in zip(params, copies)})
        return keep_read_only(result, origins, names)


class _ReadAtRest(torch.autograd.Function):
    """The gathered copy of a parameter at rest, as a function of the parameter: its backward hands
    the gradient to the parameter's own accumulation node (see [Note: differentiable reads at rest])."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, copy: Tensor) -> Tensor:
        return copy

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def write_at_rest(func: Any, args: tuple, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` where it writes into parameters at rest, or into values read from
    them (:class:`GatheredValue` s): each parameter written takes its chunk of the value written,
    as each DDP replica takes the whole (see [Note: writes at rest]). Parameters at rest that it
    only reads are gathered for the read."""
    operation = getattr(func, "__name__", str(func))
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        targets = [t for t in written_tensors(func, args, kwargs) if isinstance(t, (ParameterAtRest, GatheredValue))]
        written = {id(p): p for p in (_param_written(t, operation) for t in targets)}  # in order, once each
        _check_writable(func, operation, targets)
        inputs = input_tensors(func, args, kwargs)
        overwrites = operation in OVERWRITING or kwargs.get("out") is not None
        fulls: dict[int, Tensor] = {}  # id(param) → its full value being written
        for key, p in written.items():
            keep = not overwrites or any(_param_of(t) is p for t in inputs)
            keep = keep or not all(_covers_all(t) for t in targets if _param_of(t) is p)
            fulls[key] = ParameterAtRest.writers[key].start(keep_values=keep)  # agreed by every rank first
        reads = {
            id(a): ParameterAtRest.readers[id(a)]()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, ParameterAtRest) and id(a) not in fulls
        }
        back: dict[int, Tensor] = {}  # what `func` returns in place of a target → the target

        def swap(a: Any) -> Any:
            if isinstance(a, ParameterAtRest):
                if id(a) not in fulls:
                    return reads[id(a)]
                back[id(fulls[id(a)])] = a
                return fulls[id(a)]
            p = _param_of(a)
            if p is None or id(p) not in fulls:
                return a
            full, copy = fulls[id(p)], a._origin.copy
            view = full.as_strided(a.size(), a.stride(), full.storage_offset() + a.storage_offset() - copy.storage_offset())
            back[id(view)] = a
            return view

        with torch.no_grad():  # values only: what autograd would refuse was refused above
            swapped_args, swapped_kwargs = tree_map(swap, args), tree_map(swap, kwargs)  # alive until `back` is read
            result = func(*swapped_args, **swapped_kwargs)
            for key, full in fulls.items():
                ParameterAtRest.writers[key].finish(full)
            # the values read before that alias what was written read it now, as DDP's aliases do
            copies = {}
            for t in [*targets, *inputs]:
                p = _param_of(t)
                if isinstance(t, GatheredValue) and p is not None and id(p) in fulls:
                    copies[id(t._origin.copy)] = (t._origin.copy, fulls[id(p)])
            for copy, full in copies.values():
                copy.copy_(full)
        names = ", ".join(ParameterAtRest.names.get(key, "?") for key in fulls)
        origins = {full.untyped_storage().data_ptr(): Origin(weakref.ref(written[key]), full) for key, full in fulls.items()}
        return keep_read_only(tree_map(lambda r: back.get(id(r), r), result), origins, names)


GatheredValue.write_at_rest = staticmethod(write_at_rest)


def _param_of(t: Any) -> Optional[Tensor]:
    """The parameter at rest ``t`` is, or that a value read from it (``t``) aliases; else None."""
    if isinstance(t, ParameterAtRest):
        return t
    if isinstance(t, GatheredValue) and t._origin is not None:
        return t._origin.param()
    return None


def _param_written(t: Tensor, operation: str) -> Tensor:
    """The parameter at rest that writing into ``t`` writes; raises where none can take it."""
    p = _param_of(t)
    if p is None or id(p) not in ParameterAtRest.writers:
        if isinstance(t, ParameterAtRest):
            raise RuntimeError(type(t).refusal(t, operation))
        raise RuntimeError(
            f"`{operation}` writes into values read from parameter {t._names!r} at rest (lightning-zero stage 3),"
            " but the engine that held that parameter is gone, so the write would reach nothing. HINT: write into"
            " the module's parameter itself."
        )
    return p


def _covers_all(t: Tensor) -> bool:
    """Whether a write into ``t`` writes every element of its parameter (the parameter itself, or a
    value read from it that aliases all of its copy in order: ``p.data``, ``p.detach()``, ``p.view(-1)``)."""
    if isinstance(t, ParameterAtRest):
        return True
    copy = t._origin.copy
    return t.numel() == copy.numel() and t.is_contiguous() and t.storage_offset() == copy.storage_offset()


def _check_writable(func: Any, operation: str, targets: list[Tensor]) -> None:
    """Refuse what a chunk cannot take (see [Note: writes at rest]), naming the parameter."""
    first = _param_of(targets[0])
    name = ParameterAtRest.names.get(id(first), "a parameter")
    if operation in RESHAPING:
        raise RuntimeError(
            f"`{operation}` on parameter {name!r}, which lightning-zero holds sharded (stage 3), would change"
            " the parameter's storage, shape or autograd identity rather than its values; a sharded parameter"
            " takes new values only. Values are written as under DDP: `param.copy_(value)`, in-place"
            " arithmetic, `param[i] = v`, `torch.nn.init.*`, `module.load_state_dict(...)` (under"
            " `torch.no_grad()`, on every rank). HINT: change shapes or storage before `trainer.fit` (or in"
            " `configure_model`)."
        )
    if getattr(func, "__module__", "") == "torch.nn.init" or not torch.is_grad_enabled():
        return  # `torch.nn.init` writes under `torch.no_grad()` itself
    for t in targets:
        if t.requires_grad:
            what = "a leaf Variable" if isinstance(t, ParameterAtRest) else "a view of a leaf Variable"
            raise RuntimeError(
                f"{what} that requires grad is being used in an in-place operation: `{operation}` writes into"
                f" parameter {ParameterAtRest.names.get(id(_param_of(t)), '?')!r} under grad mode, which torch"
                " refuses for any parameter that requires a gradient. HINT: write under `with torch.no_grad():`,"
                " as `load_state_dict` and `torch.nn.init` do."
            )


def _is_data_set(func: Any) -> bool:
    """``param.data = value`` (not adopted): a write."""
    return getattr(func, "__name__", "") == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"


def _adopted(func: Any, args: tuple) -> bool:
    """Whether ``func(*args)`` is ``param.data = value`` and the engine adopted ``value``."""
    if getattr(func, "__name__", "") != "__set__" or getattr(getattr(func, "__self__", None), "__name__", "") != "data":
        return False
    adopt = ParameterAtRest.adopters.get(id(args[0]))
    return adopt is not None and adopt(args[1])


def _message(param: Any, operation: str) -> str:
    name = ParameterAtRest.names.get(id(param), "a parameter") if param is not None else "a parameter"
    return (
        f"`{operation}` on parameter {name!r}, which lightning-zero holds sharded (stage 3): outside its"
        " unit's forward and backward only this rank's chunk exists, so it would see no values. HINT:"
        " read or edit it inside `with trainer.strategy.summon_full_params():` (`writeback=True` keeps"
        " edits), which gathers every parameter on every rank."
    )


def is_at_rest(param: Any) -> bool:
    """Whether ``param`` is at rest now (a stage-3 parameter whose unit is not gathered: reads of
    it gather it, writes reach this rank's chunk)."""
    return isinstance(param, ParameterAtRest)


def put_to_rest(param: nn.Parameter) -> None:
    """After the placeholder is in: reads now fail loudly (plain ``nn.Parameter`` only)."""
    if type(param) is nn.Parameter:
        param.__class__ = ParameterAtRest


def wake(param: nn.Parameter) -> None:
    """Before the full data is in: the parameter's own class again."""
    if type(param) is ParameterAtRest:
        param.__class__ = nn.Parameter

"""A stage-3 parameter at rest: reads gather its values collectively, writes are refused.

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
``view``, ``.data``) are :class:`GatheredValue` s, which refuse writes (``gathered_value.py``); under
grad mode a read carries its gradient back to the parameter (see [Note: differentiable reads at rest]).

A write (``p.add_``, ``p.copy_``, ``p[0] = 1``, ``out=p``) is refused, naming the parameter and
``summon_full_params(writeback=True)``, except one adopted where it happens: ``param.data =
full_tensor`` (loading pretrained weights into a built model between steps) goes to the engine's
adopter for the parameter, which keeps this rank's chunk of the value, as stages 1-2 keep the
tensor, and leaves the parameter at rest (a new shape or dtype fails there, naming both). Printing a
parameter at rest describes it and never communicates.

[Note: differentiable reads at rest]
Under DDP, ``loss + lam * sum((p ** 2).sum() for p in model.parameters())`` in a training step (L2 and
L1 penalties, EWC, orthogonality terms) differentiates through the parameters. At stage 3 every
parameter outside the root unit is at rest in the training step after the forward, so a read there
runs on a gathered copy; under grad mode, for a parameter that requires a gradient, the copy is
handed to the operation through :class:`_ReadAtRest`, an identity from the parameter itself to the
copy. Its backward returns the gradient to the parameter's own ``AccumulateGrad``, which autograd
runs once per backward with every contribution summed — the unit's forward's and the read's — as
DDP's does; its post-accumulate hook then reduces the sum with the bucket, as any gradient. The
read costs what any read does, and autograd keeps what the operation saves (``p ** 2`` keeps the
copy) until the backward: a penalty over every parameter holds the whole model until then, as DDP
holds it anyway. (A second ``backward()`` reaching a parameter whose bucket the first one reduced
is refused as for any gradient: "received a gradient after its bucket was already reduced".)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.shards.gathered_value import WRITE_HINT, keep_read_only, written_tensors

DESCRIBING = frozenset(
    {
        "numel", "nelement", "dim", "size", "stride", "is_contiguous", "storage_offset", "element_size",
        "data_ptr", "untyped_storage", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "__hash__", "__len__",
    }
)  # fmt: skip
"""Tensor methods that describe a tensor without its values (property getters and setters pass too,
except ``.data``, whose getter would hand out the empty placeholder)."""


class ParameterAtRest(nn.Parameter):
    """The class of a stage-3 parameter while only this rank's chunk of it exists."""

    names: dict[int, str] = {}
    """``id(param)`` → its name in the module, for the message (filled and emptied by the engine)."""
    adopters: dict[int, Callable[[torch.Tensor], bool]] = {}
    """``id(param)`` → what takes a tensor assigned to its ``.data``, True once it did (filled and
    emptied by the engine)."""
    readers: dict[int, Callable[[], Tensor]] = {}
    """``id(param)`` → what gathers its full value for a read (a collective; see [Note: reads at
    rest]); filled and emptied by the engine. Without one, reads are refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if _adopted(func, args):
            return None
        if _describes(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        operation = getattr(func, "__name__", str(func))
        at_rest = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, ParameterAtRest)]
        written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, ParameterAtRest)]
        if written or _is_data_set(func) or any(id(p) not in cls.readers for p in at_rest):
            raise RuntimeError(cls.refusal(written[0] if written else at_rest[0] if at_rest else None, operation))
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
        return keep_read_only(result, copies, names)


class _ReadAtRest(torch.autograd.Function):
    """The gathered copy of a parameter at rest, as a function of the parameter: its backward hands
    the gradient to the parameter's own accumulation node (see [Note: differentiable reads at rest])."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, copy: Tensor) -> Tensor:
        return copy

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


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
    if id(param) in ParameterAtRest.readers:  # reads are answered: this was a write
        return (
            f"`{operation}` writes into parameter {name!r}, which lightning-zero holds sharded (stage 3): outside"
            " its unit's forward and backward only this rank's chunk exists, and reads of it are copies gathered"
            " for that read." + WRITE_HINT
        )
    return (
        f"`{operation}` on parameter {name!r}, which lightning-zero holds sharded (stage 3): outside its"
        " unit's forward and backward only this rank's chunk exists, so it would see no values. HINT:"
        " read or edit it inside `with trainer.strategy.summon_full_params():` (`writeback=True` keeps"
        " edits), which gathers every parameter on every rank."
    )


def is_at_rest(param: Any) -> bool:
    """Whether ``param`` is at rest now (a stage-3 parameter whose unit is not gathered: reads of
    it gather it, writes are refused)."""
    return isinstance(param, ParameterAtRest)


def put_to_rest(param: nn.Parameter) -> None:
    """After the placeholder is in: reads now fail loudly (plain ``nn.Parameter`` only)."""
    if type(param) is nn.Parameter:
        param.__class__ = ParameterAtRest


def wake(param: nn.Parameter) -> None:
    """Before the full data is in: the parameter's own class again."""
    if type(param) is ParameterAtRest:
        param.__class__ = nn.Parameter

"""What a read of a stage-3 parameter at rest hands out, and how a write is told from a read.

A read at rest (see [Note: reads at rest] in ``at_rest.py``) runs on a full copy gathered for that
one read. Under DDP, ``p.detach()``, ``p.view(-1)``, ``p.data`` or ``p.cpu()`` (on a CPU model) alias
the parameter, so a write through them reaches it; here they alias the copy. So a result that
aliases a gathered copy is a :class:`GatheredValue`: it reads as any tensor (its own reads give
plain tensors, copies such as ``clone()`` are plain tensors), and a write into it is made a write
into the parameter it was read from (see [Note: writes at rest] in ``at_rest.py``): it knows that
parameter and the copy it aliases (:class:`Origin`). Writes are recognised by torch's naming
(``add_``, ``copy_``, ``__setitem__``, ``__iadd__``, ``out=``), as ``torch.nn.init`` and optimizers
write through them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

AT_REST_MARK = "_lightning_zero_at_rest"
"""A class attribute of the classes of parameters at rest (``at_rest.py``): a :class:`GatheredValue`
leaves an operation that involves one of them to that class's ``__torch_function__``, which
gathers the parameter first."""


class Origin(NamedTuple):
    """Where a :class:`GatheredValue` comes from."""

    param: "weakref.ref[Tensor]"
    """The parameter at rest it was read from (weakly: a value read may outlive the model)."""
    copy: Tensor
    """The full copy gathered for that read, which it aliases (the parameter's shape, contiguous)."""


def _target_position(func: Any, args: tuple, kwargs: Optional[dict]) -> tuple[str, Any]:
    """Where the tensors ``func(*args, **kwargs)`` writes into are passed: ("args", 0) for an
    in-place method or function, ("kwargs", key) for one given by keyword (``torch.nn.init``'s
    ``handle_torch_function(constant_, (tensor,), tensor=tensor, val=val)``), ("out", "out") for
    ``out=``; ("", None) for a read."""
    name = getattr(func, "__name__", "")
    if kwargs and kwargs.get("out") is not None:
        return "out", "out"
    in_place = name.endswith("_") and not name.endswith("__")
    augmented = name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__")
    if in_place or augmented or name in ("__setitem__", "set_"):
        if args:
            return "args", 0
        for key in ("tensor", "input", "self"):
            if kwargs and key in kwargs:
                return "kwargs", key
    return "", None


def written_tensors(func: Any, args: tuple, kwargs: Optional[dict]) -> list[Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes into (in-place methods and functions, item
    assignment, augmented assignment, ``out=``); [] for a read."""
    where, key = _target_position(func, args, kwargs)
    if not where:
        return []
    target = args[key] if where == "args" else kwargs[key]  # type: ignore[index]
    return [t for t in tree_flatten(target)[0] if isinstance(t, Tensor)]


def input_tensors(func: Any, args: tuple, kwargs: Optional[dict]) -> list[Tensor]:
    """The tensors ``func(*args, **kwargs)`` reads: every tensor argument but the one(s) it writes
    into, at the place it writes them (``p.add_(p)`` reads ``p``)."""
    where, key = _target_position(func, args, kwargs)
    rest_kwargs = dict(kwargs or {})
    rest_args = args
    if where == "args":
        rest_args = args[1:]
    elif where:
        rest_kwargs.pop(key)
    return [t for t in tree_flatten((rest_args, rest_kwargs))[0] if isinstance(t, Tensor)]


class GatheredValue(Tensor):
    """A tensor aliasing a full copy gathered for a read at rest: it reads as that copy, and a
    write into it is a write into the parameter (see [Note: writes at rest] in ``at_rest.py``)."""

    _names: str
    """The parameter(s) it was read from, for messages."""
    _origin: Optional[Origin]
    write_at_rest: Callable[[Any, tuple, Any], Any]
    """How a write into such a value is made: ``at_rest.write_at_rest``, set there (only reads at
    rest make these values, so it is set before any exists; set, not imported: ``at_rest`` imports
    this module)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(getattr(t, AT_REST_MARK, False) for t in types):
            return NotImplemented  # a parameter at rest takes part: its class gathers it first
        with torch._C.DisableTorchFunctionSubclass():
            written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, GatheredValue)]
        if written:
            return GatheredValue.write_at_rest(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            sources = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, GatheredValue)]
            result = func(*args, **(kwargs or {}))
            return keep_read_only(result, origins_of(sources), sources[0]._names if sources else "")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # printed as the plain tensor it reads as
        with torch._C.DisableTorchFunctionSubclass():
            return repr(self.as_subclass(Tensor))

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (torch.save) as the plain tensor it reads as
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor).__reduce_ex__(protocol)


def origins_of(values: list[Any]) -> dict[int, Optional[Origin]]:
    """The origins of ``values`` (:class:`GatheredValue` s), by the storage they alias. Call it with
    torch functions of subclasses disabled."""
    return {v.untyped_storage().data_ptr(): v._origin for v in values if isinstance(v, GatheredValue) and v.numel() > 0}


def keep_read_only(result: Any, origins: dict[int, Optional[Origin]], names: str) -> Any:
    """``result`` with every tensor that aliases one of the storages in ``origins`` (gathered
    copies, by data pointer) made a :class:`GatheredValue` of that origin; other tensors and
    non-tensors as they are. Call it with torch functions of subclasses disabled."""
    if not origins:
        return result

    def mark(t: Any) -> Any:
        if type(t) is Tensor and t.numel() > 0:
            storage = t.untyped_storage().data_ptr()
            if storage in origins:
                value = t.as_subclass(GatheredValue)
                value._names, value._origin = names, origins[storage]
                return value
        return t

    return tree_map(mark, result)
